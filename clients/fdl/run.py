"""`fdl run PROGRAM [-- ARGS]`: the main job on this machine, controller embedded.

With no `cluster:` block in the project's fdl.yml (the embedded default) it starts a controller
in-process on 127.0.0.1 (free port) and one local agent that joins over loopback, with one rank per
GPU (backend nccl) when this host has a GPU, else `--ranks N` CPU ranks (default 2, backend gloo).
The first progress line says which.

Choosing the ranks of the embedded default (three spellings of one choice; when several are given
they must agree, else exit 2):
  --devices SPEC          as `fdl join --devices`: 'all' (every GPU; --ranks CPU ranks when there is
                          none), '0,1' or 'cuda:1' (those GPUs), 'cpu:N' (N CPU ranks), 'cpu,cpu'
  --nproc-per-node N|gpu|cpu  torchrun's spelling: N ranks (the first N GPUs, or N CPU ranks on a
                          host without GPU), gpu (every GPU; an error without one), cpu (one CPU
                          rank per core)
  --ranks N               N CPU ranks
Ranks on GPUs only use backend nccl; any CPU rank makes it gloo.

With a cluster block (`fdl @cluster run`), the overlay's controller settings are used and local
workers get a local agent; remote workers walk in with `fdl join`. Progress lines go to stderr;
the exit code is the run's verdict (0 done, 1 failed, 2 bad usage).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.cli import Command
from flodld import api

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CPU_RANKS = 2


def _add_options(parser: argparse.ArgumentParser) -> None:
    add_rank_options(parser)
    parser.add_argument("--port", type=int, default=None, help="controller port (default: a free one)")
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """--devices, --nproc-per-node, --ranks: the embedded default's ranks (`fdl probe` takes them too)."""
    parser.add_argument("--devices", default=None, metavar="SPEC",
                        help="ranks of the embedded default, as `fdl join --devices`: 'all' (every GPU, the "
                             "default), '0,1', 'cuda:1', 'cpu:N'")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None,
                        metavar="N|gpu|cpu",
                        help="torchrun's spelling of the same choice: N ranks (first N GPUs, or N CPU ranks "
                             "without GPU), gpu (every GPU), cpu (one CPU rank per core)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"CPU ranks of the embedded default (default {DEFAULT_CPU_RANKS} when there is no GPU)",
    )


def configure_parser(parser: argparse.ArgumentParser) -> None:
    _add_options(parser)
    program = "the training program (a .py file or an executable), then -- and its arguments"
    add_rest(parser, metavar="PROGRAM [-- ARGS]", help=program)


def add_rest(parser: argparse.ArgumentParser, *, metavar: str, help: str) -> None:
    """The positional `rest`: everything after the options, which `reparse` finishes parsing."""
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar=metavar, help=help)


def split_at_dashdash(rest: list[str]) -> tuple[list[str], list[str] | None]:
    """(our words, PROGRAM's arguments) split at the first `--`; None when there was no `--`."""
    if "--" in rest:
        index = rest.index("--")
        return rest[:index], rest[index + 1 :]
    return rest, None


def reparse(
    args: argparse.Namespace,
    add_options: Callable[[argparse.ArgumentParser], object],
    positional: Callable[[argparse.ArgumentParser], object],
) -> list[str] | None:
    """Finish parsing what `add_rest`'s REMAINDER swallowed (options may follow it), into `args`."""
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
    found = (
        shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    )
    if found is None:
        raise FileNotFoundError(f"program {program!r} is neither a .py file nor an executable on PATH")
    return [found, *args]


@dataclass(frozen=True)
class LocalRanks:
    """The ranks the embedded default starts on this host: resolved devices, one per rank."""

    devices: tuple[str, ...]  # 'cuda:I' or 'cpu:K' (K the CPU rank's ordinal), as resolve_devices gives them
    reason: str  # which flag (or the default) chose them
    cuda_count: int  # GPUs this host has

    @property
    def backend(self) -> str:
        return "nccl" if all(device.startswith("cuda:") for device in self.devices) else "gloo"

    @property
    def entries(self) -> list[str]:
        """The worker's `local_devices:` entries: its GPUs, then its CPU ranks as one 'cpu:N'."""
        cpu = sum(1 for device in self.devices if device.startswith("cpu"))
        return [device for device in self.devices if device.startswith("cuda:")] + (
            [f"cpu:{cpu}"] if cpu else []
        )

    def describe(self) -> str:
        """'2 GPU rank(s) on cuda:0, cuda:1, backend nccl (every GPU on this host)'."""
        line = f"{_describe_devices(self.devices)}, backend {self.backend} ({self.reason})"
        if self.cuda_count and not any(device.startswith("cuda:") for device in self.devices):
            line += (
                f"; this host has {self.cuda_count} GPU(s): --nproc-per-node gpu (or --devices all) "
                "runs one rank on each"
            )
        return line


def _describe_devices(devices: tuple[str, ...]) -> str:
    """'2 GPU rank(s) on cuda:0, cuda:1', '3 CPU rank(s)', or both joined by ' + '."""
    gpus = [device for device in devices if device.startswith("cuda:")]
    cpus = len(devices) - len(gpus)
    parts = ([f"{len(gpus)} GPU rank(s) on {', '.join(gpus)}"] if gpus else []) + (
        [f"{cpus} CPU rank(s)"] if cpus else []
    )
    return " + ".join(parts)


def _cpu_ranks(count: int, flag: str) -> tuple[str, ...]:
    if count < 1:
        raise ValueError(f"{flag} asks for {count} CPU ranks; ask for at least 1")
    return tuple(f"cpu:{index}" for index in range(count))


# Device nodes a GPU driver creates (NVIDIA, AMD ROCm, WSL's GPU paravirtualization). With none of them
# there is no GPU torch could use, and `fdl run` need not import torch (a second or more) to learn it.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd", "/dev/dxg")


def cuda_device_count() -> int:
    """GPUs torch can use on this host (0 for a CPU build or no driver)."""
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def choose_local_ranks(
    *,
    devices: str | None = None,
    nproc_per_node: str | None = None,
    ranks: int | None = None,
    cuda_count: int | None = None,
) -> LocalRanks:
    """Resolve --devices / --nproc-per-node / --ranks (spellings of one choice) to this host's ranks.

    None given: every GPU, else DEFAULT_CPU_RANKS CPU ranks. ValueError (exit 2) names a bad value, or
    two flags that ask for different ranks. `cuda_count` is probed through torch when None.
    """
    count = cuda_device_count() if cuda_count is None else cuda_count
    cpu_fallback = ranks if ranks is not None else DEFAULT_CPU_RANKS
    asked: list[tuple[str, tuple[str, ...]]] = []
    if devices is not None:
        flag = f"--devices {devices}"
        entries = api.parse_device_list(devices)  # the parser of `fdl join --devices`
        if [entry.lower() for entry in entries] == ["all"] and not count:
            # as for `fdl join --devices all` on a host without GPU: CPU ranks instead
            asked.append((flag, _cpu_ranks(cpu_fallback, f"--ranks {cpu_fallback}")))
        else:
            asked.append((flag, tuple(api.resolve_devices(entries, cuda_count=count))))
    if nproc_per_node is not None:
        asked.append((f"--nproc-per-node {nproc_per_node}", _nproc_devices(nproc_per_node, count)))
    if ranks is not None:
        asked.append((f"--ranks {ranks}", _cpu_ranks(ranks, f"--ranks {ranks}")))
    if not asked:
        if count:
            return LocalRanks(
                tuple(f"cuda:{index}" for index in range(count)), "every GPU on this host", count
            )
        return LocalRanks(
            _cpu_ranks(DEFAULT_CPU_RANKS, "--ranks"), "no GPU on this host; --ranks N sets the count", count
        )
    (first_flag, chosen), *others = asked
    for flag, other in others:
        if sorted(other) != sorted(chosen):  # the same ranks, whatever order they were listed in
            raise ValueError(
                f"{first_flag} asks for {_describe_devices(chosen)} but {flag} asks for "
                f"{_describe_devices(other)}; they are spellings of the same choice: "
                "give one, or make them agree"
            )
    return LocalRanks(chosen, "from " + " and ".join(flag for flag, _ in asked), count)


def _nproc_devices(value: str, cuda_count: int) -> tuple[str, ...]:
    """Torchrun's --nproc-per-node: N, gpu or cpu, as this host's devices (one rank each)."""
    word = value.strip().lower()
    if word == "gpu":
        if not cuda_count:
            raise ValueError(
                "--nproc-per-node gpu: this host has no CUDA device; use --nproc-per-node N "
                "or --ranks N for CPU ranks"
            )
        return tuple(f"cuda:{index}" for index in range(cuda_count))
    if word == "cpu":
        return _cpu_ranks(os.cpu_count() or 1, "--nproc-per-node cpu")
    try:
        count = int(word)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {value!r} is not understood; accepted: a number of ranks, "
            "'gpu' (one per GPU) or 'cpu' (one per CPU core)"
        ) from None
    if count < 1:
        raise ValueError(f"--nproc-per-node {count}: ask for at least 1 rank")
    if not cuda_count:
        return _cpu_ranks(count, f"--nproc-per-node {count}")
    if count > cuda_count:
        raise ValueError(
            f"--nproc-per-node {count}: this host has {cuda_count} CUDA device(s) and a GPU runs one "
            f"rank; ask for at most {cuda_count}, or for CPU ranks with --devices cpu:{count}"
        )
    return tuple(f"cuda:{index}" for index in range(count))


def embedded_cluster(local: LocalRanks) -> api.ClusterConfig:
    """The embedded default: controller on 127.0.0.1 (free port), one local worker with these ranks,
    cpu_sync averaging through the relay, over nccl (GPU ranks only) or gloo.
    """
    return (
        api.ClusterBuilder()
        .controller("127.0.0.1", 0, averaging="cpu_sync", backend=local.backend)
        .worker("127.0.0.1", devices=local.entries)
        .build()
    )


def _project_cluster(args: argparse.Namespace) -> api.ClusterConfig | None:
    """The project's cluster block (with the selected overlay), or None for the embedded default."""
    env = getattr(args, "env", None) or os.environ.get("FDL_ENV") or None
    try:
        project = api.load_config(getattr(args, "project", "."), env)
    except api.ConfigNotFoundError:
        return None
    return project.cluster


def local_devices_counts(cluster: api.ClusterConfig, cuda_count: int | None = None) -> dict[str, int]:
    """The GPU count of every worker on this host with `local_devices: all` (what capacity needs).

    ValueError when there is such a worker and this host has no GPU: `all` offers GPUs only.
    `cuda_count` is probed through torch when None.
    """
    local = [
        host
        for host in cluster.hosts_to_probe
        if (worker := cluster.worker(host)) is not None and worker.is_local(cluster.controller.host)
    ]
    if not local:
        return {}
    count = cuda_device_count() if cuda_count is None else cuda_count
    if not count:
        raise ValueError(
            f"worker {local[0]!r} has local_devices: all, but this host has no CUDA device; "
            "list CPU ranks instead (e.g. local_devices: [cpu:2])"
        )
    return dict.fromkeys(local, count)


def plan_run(args: argparse.Namespace) -> tuple[api.ClusterConfig, str]:
    """(the cluster config `fdl run` starts, what it is: 'the embedded default: 2 CPU rank(s), ...').

    ValueError (exit 2) for bad usage: a bad or contradictory rank flag, rank flags next to a
    cluster: block, an unreadable fdl.yml.
    """
    devices, nproc, ranks = (getattr(args, name, None) for name in ("devices", "nproc_per_node", "ranks"))
    cluster = _project_cluster(args)
    if cluster is not None:
        given = [
            flag
            for flag, value in (("--devices", devices), ("--nproc-per-node", nproc), ("--ranks", ranks))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} only size the embedded default; this project's fdl.yml has "
                "a cluster: block (list the ranks in its workers' local_devices)"
            )
        local = [worker for worker in cluster.workers if worker.is_local(cluster.controller.host)]
        if any(worker.host in cluster.hosts_to_probe for worker in local):
            local_devices_counts(cluster)  # raises (exit 2) before anything starts when there is no GPU
        return cluster, (
            f"the cluster: block of fdl.yml: {len(cluster.workers)} worker(s), {len(local)} on this "
            f"host, backend {cluster.controller.backend.value}"
        )
    local_ranks = choose_local_ranks(devices=devices, nproc_per_node=nproc, ranks=ranks)
    return embedded_cluster(local_ranks), f"the embedded default: {local_ranks.describe()}"


async def run_job(command: list[str], cluster: api.ClusterConfig, *, port: int | None = None) -> int:
    overrides: dict[str, Any] = {"preshared": True}  # local agents get the salt in their environment
    if port is not None:
        overrides["port"] = port
    if cluster.controller.host in ("127.0.0.1", "localhost"):
        overrides["bind_host"] = "127.0.0.1"
    local = [worker for worker in cluster.workers if worker.is_local(cluster.controller.host)]
    # The agents start first, their spec to follow on stdin: their imports overlap the controller's start.
    # The agent is flodld's own process; the program starts only as its ranks (a stock torchrun script works).
    agents: list[asyncio.subprocess.Process] = [
        await asyncio.create_subprocess_exec(
            *api.agent_command(),
            env={**os.environ, **worker.env, api.AGENT_ENV: api.SPEC_ON_STDIN},
            stdin=asyncio.subprocess.PIPE,
        )
        for worker in local
    ]
    try:
        probed = local_devices_counts(cluster)  # every worker here is local
        options = api.ControllerOptions.from_cluster(cluster, probed=probed, **overrides)
        controller = api.assemble_controller(
            options, on_phase=lambda phase, reason: say(f"{phase.value}" + (f" — {reason}" if reason else ""))
        )
        _, bound_port = await controller.start()
    except BaseException:
        for agent in agents:  # never told what to join: they go without a word
            agent.kill()
            await agent.wait()
        raise
    say(
        f"controller on 127.0.0.1:{bound_port} (run {controller.run_id}); join window open for "
        f"{options.capacity} rank(s); starting {len(local)} local agent(s)"
    )
    pre_shared = controller.join_key != api.OPEN_ADMISSION_KEY
    for worker, agent in zip(local, agents, strict=True):
        spec = api.AgentSpec(
            host=worker.host,
            controller_host="127.0.0.1",
            controller_port=bound_port,
            salt_hex=controller.salt_hex if pre_shared else None,
            devices=list(worker.local_devices) if worker.local_devices != "all" else None,
            averaging=options.averaging,
            cluster_env=True,
            host_env=worker.rank_env() or None,
            program=command,
        )
        assert agent.stdin is not None
        agent.stdin.write(api.encode_spec(spec).encode() + b"\n")  # the salt never enters its environment
        with contextlib.suppress(ConnectionError):  # an agent that already died is reported below
            await agent.stdin.drain()
        agent.stdin.close()

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
                await controller.stop(
                    f"the agent of host {worker.host!r} died ({_describe(task.result())}) "
                    "without reporting its ranks"
                )
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
    await controller.linger_for_readers()  # a `fdl status --watch` then sees the verdict
    await controller.close()
    died = [
        (worker.host, agent.returncode)
        for worker, agent in zip(local, agents, strict=True)
        if agent.returncode is not None and agent.returncode < 0
    ]
    if result.ok and died:
        # A killed agent closes its link like a finished one; its unreported ranks make the run lost.
        host, code = died[0]
        say(
            f"run FAILED: the agent of host {host!r} died ({_describe(code)}); the controller saw its host "
            f"link close ({result.reason})"
        )
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
        cluster, plan = plan_run(args)
    except (FileNotFoundError, ValueError) as error:
        say(str(error))
        return EXIT_USAGE
    say(f"starting {plan}")
    # Plain asyncio: the controller's mux checks for asyncio.Transport, which uvloop's transports are not.
    if any(not worker.is_local(cluster.controller.host) for worker in cluster.workers):
        # cluster_run loads asyncssh: only when there is a remote worker.
        return asyncio.run(api.run_cluster_job(args.program, tail or [], cluster, port=args.port))
    return asyncio.run(run_job(command, cluster, port=args.port))


COMMAND = Command("run", "run a program on every rank (controller embedded)", __doc__, configure_parser, main)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
