"""The controller daemon: one port (mux), the join window's shell, rendezvous store, HTTP status.

Programmatic use (what `fdl run` and tests do):

    from flodld.controller.options import ControllerOptions
    from flodld.controller.run import Controller

    controller = Controller(ControllerOptions(...))   # or Controller(cluster_config)
    host, port = await controller.start()
    result = await controller.wait()                  # RunResult(verdict, reason)
    await controller.close()

`flodld serve` (flodld.controller.daemon) wraps the same object with signals and systemd readiness.

This file imports nothing: importing a module of the package, such as the pure
`flodld.controller.status.summary` that `fdl status` uses, does not load the controller (aiohttp).
"""
