"""`fdl run PROGRAM [-- ARGS]`: the main job on this machine, controller embedded.

With no `cluster:` block in the project's fdl.yml (the embedded default) it starts a controller
in-process on 127.0.0.1 (free port) and one local agent with CPU ranks (`--ranks N`, default 2)
that joins over loopback. With a cluster block (`fdl @cluster run`), the overlay's controller
settings are used and local workers get a local agent; remote workers walk in with `fdl join`.
Progress lines go to stderr; the exit code is the run's verdict (0 done, 1 failed, 2 bad usage).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "run", help="run a program on every rank (controller embedded)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)
    return parser


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=None, help="CPU ranks of the embedded default (default 2)")
    parser.add_argument("--port", type=int, default=None, help="controller port (default: a free one)")
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    _add_options(parser)
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="PROGRAM [-- ARGS]",
                        help="the training program (a .py file or an executable), then -- and its arguments")


def split_at_dashdash(rest: list[str]) -> tuple[list[str], list[str] | None]:
    """(our words, PROGRAM's arguments) split at the first `--`; None when there was no `--`."""
    if "--" in rest:
        index = rest.index("--")
        return rest[:index], rest[index + 1 :]
    return rest, None


def reparse(args: argparse.Namespace, add_options: Any, positional: Any) -> list[str] | None:
    """Finish parsing what REMAINDER swallowed (options may follow the positional), into `args`."""
    head, tail = split_at_dashdash(list(args.rest))
    parser = argparse.ArgumentParser(add_help=False, prog="fdl")
    add_options(parser)
    positional(parser)
    parser.parse_args(head, namespace=args)
    return tail


def say(message: str) -> None:
    sys.stderr.write(f"fdl run: {message}\n")  # one write: lines of concurrent processes never interleave
    sys.stderr.flush()


def program_command(program: str, args: list[str]) -> list[str]:
    """How to start PROGRAM: Python files with this interpreter, anything else as an executable."""
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise FileNotFoundError(f"program {program!r} not found (relative to {os.getcwd()})")
        return [sys.executable, program, *args]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None:
        raise FileNotFoundError(f"program {program!r} is neither a .py file nor an executable on PATH")
    return [found, *args]


def _load_cluster(args: argparse.Namespace) -> Any:
    """The cluster config to run: the project's (with the selected overlay) or the embedded default."""
    from flodld.config.defaults import embedded_default
    from flodld.config.errors import ConfigNotFoundError
    from flodld.config.loader import load_config

    env = getattr(args, "env", None) or os.environ.get("FDL_ENV") or None
    try:
        project = load_config(args.project, env)
    except ConfigNotFoundError:
        project = None
    if project is not None and project.cluster is not None:
        if args.ranks is not None:
            raise ValueError("--ranks only sizes the embedded default; this project's fdl.yml has a cluster: block")
        return project.cluster
    return embedded_default(args.ranks if args.ranks is not None else 2)


async def run_job(command: list[str], cluster: Any, *, port: int | None = None) -> int:
    from flodld.controller.dataplane import attach_data_plane
    from flodld.controller.options import ControllerOptions
    from flodld.controller.run import Controller
    from flodld.wire.salt import OPEN_ADMISSION_KEY

    overrides: dict[str, Any] = {}
    if port is not None:
        overrides["port"] = port
    if cluster.controller.host in ("127.0.0.1", "localhost"):
        overrides["bind_host"] = "127.0.0.1"
    options = ControllerOptions.from_cluster(cluster, probed=None, **overrides)
    controller = Controller(options)
    controller.on_phase(lambda phase, reason: say(f"{phase.value}" + (f" — {reason}" if reason else "")))
    attach_data_plane(controller)
    _, bound_port = await controller.start()
    local = [worker for worker in cluster.workers if worker.is_local(cluster.controller.host)]
    say(f"controller on 127.0.0.1:{bound_port} (run {controller.run_id}); join window open for "
        f"{options.capacity} rank(s); starting {len(local)} local agent(s)")
    pre_shared = controller.join_key != OPEN_ADMISSION_KEY
    agents: list[asyncio.subprocess.Process] = []
    for worker in local:
        spec = AgentSpec(
            host=worker.host, controller_host="127.0.0.1", controller_port=bound_port,
            salt_hex=controller.salt_hex if pre_shared else None,
            devices=list(worker.local_devices) if worker.local_devices != "all" else None,
            averaging=options.averaging,
        )
        env = {**os.environ, AGENT_ENV: encode_spec(spec)}
        agents.append(await asyncio.create_subprocess_exec(*command, env=env, stdin=asyncio.subprocess.DEVNULL))

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted.set)
    result_task = asyncio.ensure_future(controller.wait())
    agent_tasks = [asyncio.ensure_future(agent.wait()) for agent in agents]
    interrupt_task = asyncio.ensure_future(interrupted.wait())
    pending = {result_task, interrupt_task, *agent_tasks}
    while not result_task.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if interrupt_task in done:
            say("interrupted; aborting the run")
            await controller.stop("interrupted by the operator (fdl run)")
            break
        for worker, task in zip(local, agent_tasks, strict=True):
            if task not in done or task.result() == 0 or result_task.done():
                continue
            # The agent reports its ranks and closes its link before exiting; give the controller a
            # moment to conclude from that, else the agent died unannounced and the run is lost.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(result_task), 2.0)
            if not result_task.done():
                await controller.stop(f"the agent of host {worker.host!r} died ({_describe(task.result())}) "
                                      "without reporting its ranks")
        if agent_tasks and all(task.done() for task in agent_tasks) and not result_task.done():
            # Every local host link is closed; give the controller a moment to conclude.
            try:
                await asyncio.wait_for(asyncio.shield(result_task), 5.0)
            except TimeoutError:
                await controller.stop("every local agent exited but the run did not conclude")
    result = await result_task
    for agent in agents:
        if agent.returncode is None:
            try:
                await asyncio.wait_for(agent.wait(), 15.0)
            except TimeoutError:
                agent.kill()
                await agent.wait()
    await controller.close()
    died = [(worker.host, agent.returncode) for worker, agent in zip(local, agents, strict=True)
            if agent.returncode is not None and agent.returncode < 0]
    if result.ok and died:
        # A killed agent closes its link like a finished one; its unreported ranks make the run lost.
        host, code = died[0]
        say(f"run FAILED: the agent of host {host!r} died ({_describe(code)}); the controller saw its host link "
            f"close ({result.reason})")
        return EXIT_FAILED
    if result.ok:
        say(f"run done: {result.reason}")
        return EXIT_DONE
    say(f"run FAILED: {result.reason}")
    return EXIT_FAILED


def _describe(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="fdl run: controller: %(message)s")
    try:
        tail = reparse(args, _add_options, lambda p: p.add_argument("program", nargs="?"))
        if not args.program:
            raise ValueError("no program given: fdl run PROGRAM [-- ARGS]")
        command = program_command(args.program, tail or [])
        cluster = _load_cluster(args)
    except (FileNotFoundError, ValueError) as error:
        say(str(error))
        return EXIT_USAGE
    from flodld.fanout.cluster_run import has_remote_workers, run_cluster_job

    # Plain asyncio: the controller's mux checks for asyncio.Transport, which uvloop's transports are not.
    if has_remote_workers(cluster):
        return asyncio.run(run_cluster_job(args.program, tail or [], cluster, port=args.port))
    return asyncio.run(run_job(command, cluster, port=args.port))


if __name__ == "__main__":
    standalone = argparse.ArgumentParser(prog="fdl run", description=__doc__)
    configure_parser(standalone)
    sys.exit(main(standalone.parse_args()))
