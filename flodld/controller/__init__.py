"""The controller daemon: one port (mux), the join window's shell, rendezvous store, HTTP status.

Programmatic use (what `fdl run` and tests do):

    controller = Controller(ControllerOptions(...))   # or Controller(cluster_config)
    host, port = await controller.start()
    result = await controller.wait()                  # RunResult(verdict, reason)
    await controller.close()

`flodld serve` (flodld.controller.daemon) wraps the same object with signals and systemd readiness.
"""

from __future__ import annotations

from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.controller.runparts import RunResult

__all__ = ["Controller", "ControllerOptions", "RunResult"]
