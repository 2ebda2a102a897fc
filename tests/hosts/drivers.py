"""Entry points the multi-host tests start inside a network namespace (`python -m tests.hosts.drivers`).

fanout CLUSTER_JSON PROGRAM [ARGS...]   the launcher side of `fdl @cluster run`
serve OPTIONS_JSON                      a bare controller (prints `listening HOST:PORT`, exits 0 on done)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def fanout(cluster_json: str, program: str, args: list[str]) -> int:
    from flodld.config.models import ClusterConfig
    from flodld.fanout.cluster_run import run_cluster_job

    cluster = ClusterConfig.model_validate(json.loads(Path(cluster_json).read_text()))
    return asyncio.run(run_cluster_job(program, args, cluster, grace_s=3))


async def _serve(options_json: str) -> int:
    from flodld.controller.dataplane import attach_data_plane
    from flodld.controller.options import ControllerOptions
    from flodld.controller.run import Controller

    controller = Controller(ControllerOptions.model_validate(json.loads(Path(options_json).read_text())))
    attach_data_plane(controller)
    host, port = await controller.start()
    print(f"listening {host}:{port}", flush=True)
    result = await controller.wait()
    await controller.close()
    print(f"result {result.verdict.value}: {result.reason}", flush=True)
    return 0 if result.ok else 1


def main(argv: list[str]) -> int:
    if argv[0] == "fanout":
        return fanout(argv[1], argv[2], argv[3:])
    if argv[0] == "serve":
        return asyncio.run(_serve(argv[1]))
    raise SystemExit(f"unknown driver {argv[0]!r}; see the module docstring")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
