"""Entry points the multi-host tests start inside a network namespace (`python -m tests.hosts.drivers`).

fanout CLUSTER_JSON PROGRAM [ARGS...]   the launcher side of `fdl @cluster run`
serve OPTIONS_JSON                      a bare controller (prints `listening HOST:PORT`, exits 0 on done)
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import signal
import sys
from pathlib import Path


def dump_tasks() -> None:
    """Every asyncio task's stack and every thread's, to stderr (the launcher's log): what a test that timed
    out sends SIGUSR1 for, so a hang is named by where it waits.
    """
    print("--- SIGUSR1: asyncio tasks ---", file=sys.stderr, flush=True)
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


async def _fanout(cluster_json: str, program: str, args: list[str]) -> int:
    from flodld.config.models import ClusterConfig
    from flodld.fanout.cluster_run import run_cluster_job

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    cluster = ClusterConfig.model_validate(json.loads(Path(cluster_json).read_text()))
    return await run_cluster_job(program, args, cluster, grace_s=3)


async def _serve(options_json: str) -> int:
    from flodld.controller.attachplane import attach_data_plane
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
        return asyncio.run(_fanout(argv[1], argv[2], argv[3:]))
    if argv[0] == "serve":
        return asyncio.run(_serve(argv[1]))
    raise SystemExit(f"unknown driver {argv[0]!r}; see the module docstring")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
