"""`fdl run [OPTIONS] PROGRAM [ARGS...]`: the main job on this machine, controller embedded.

As with torchrun, every word after PROGRAM is PROGRAM's: `fdl run train.py 1 5 --batch_size 4 --port 29999`
gives train.py all six words and fdl's options only come before PROGRAM. (A `--` right after PROGRAM, the
older spelling `fdl run PROGRAM -- ARGS`, is dropped; write `-- --` to pass a literal `--`.)

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

torchrun's flags, so that a torchrun command line ports by renaming the command:
  -m/--module, --no-python, --run-path   as torchrun: PROGRAM is a module (`python -m`), an executable run
                          as is, or a Python file whatever its name
  --standalone            the embedded default (what fdl run does anyway)
  --nnodes N|MIN:MAX      one host: accepted. Several: only with a cluster: block (walk-ins make the
                          hosts) and --nproc-per-node N, as the join window's quorum MIN x N and
                          target MAX x N ranks (controller.join.min_rank_start/target_ranks)
  --max-restarts N        re-form a failed attempt as a fresh world up to N times (ranks see
                          TORCHELASTIC_RESTART_COUNT; default controller.join.max_restarts, else 0)
  --rdzv-endpoint HOST:PORT, or --master-addr HOST [--master-port PORT] with --node-rank >= 1:
                          walk in to the controller there instead (as `fdl join HOST:PORT`; the token
                          from FDL_JOIN_TOKEN or the fdl.yml join: block); rank flags size this host
  --rdzv-conf join_timeout=SECS   the join window's length (controller.join.join_timeout)
  --rdzv-backend c10d|static, --rdzv-id, --master-addr/--master-port on node 0, --node-rank 0,
  --monitor-interval, --start-method spawn   accepted; they have nothing to set here (a line says so)
  --local-ranks-filter R[,R]  show only these ranks' output lines (the embedded default's one host: its
                          local ranks); the controller's and agents' lines still show
  --log-dir DIR, -r/--redirects N, -t/--tee N   as torchrun: per-rank stdout.log/stderr.log under
                          DIR/RUN/attempt_N/HOST/rank_R/; --redirects keeps the streams it names off the
                          terminal, --tee shows them too; N is 0-3 (none, stdout, stderr, both) or per local
                          rank (0:3,1:2). Default from fdl.yml's logs: block. Read them with `fdl logs`.
Any other torchrun flag is refused with the flodld equivalent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl import join
from fdl.cli import Command
from fdl.logs import add_log_options, config_logs, resolve_logs
from fdl.progargs import add_rest, program_command
from fdl.torchrun import TorchrunPlan, add_torchrun_options, torchrun_plan
from flodld import api

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CPU_RANKS = 2


def _add_options(parser: argparse.ArgumentParser) -> None:
    add_rank_options(parser)
    parser.add_argument("--port", type=int, default=None, help="controller port (default: a free one)")
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")
    add_log_options(parser)
    add_torchrun_options(parser)


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
    program = "the training program (a .py file or an executable), then every word after it (as torchrun)"
    add_rest(parser, metavar="PROGRAM [ARGS...]", help=program)


NO_VALUE_FLAGS = frozenset({
    "-h", "--help", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
    "--standalone",
})  # fmt: skip
"""The options of fdl run that take no value; any other before PROGRAM takes one (or `--opt=value`)."""


def program_start(words: list[str]) -> int:
    """Where PROGRAM is in the words after `run` (len(words) when there is none): the first word that is
    neither an option nor an option's value, or the `--` that ends the options.
    """
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--" or not word.startswith("-") or word == "-":
            return index
        attached = len(word) > 2 and word[1] != "-"  # a short flag with its value: -r3, -t0:3
        index += 1 if word in NO_VALUE_FLAGS or "=" in word or attached else 2
    return len(words)


def split_program(rest: list[str]) -> tuple[str | None, list[str]]:
    """(PROGRAM, its arguments) from what follows fdl run's options: as torchrun, every word after PROGRAM
    is PROGRAM's. A `--` before PROGRAM ends the options; one right after PROGRAM is dropped (the older
    spelling `fdl run PROGRAM -- ARGS`). None when no program was given.
    """
    words = list(rest)
    if words[:1] == ["--"]:
        words.pop(0)
    if not words:
        return None, []
    arguments = words[1:]
    return words[0], arguments[1:] if arguments[:1] == ["--"] else arguments


@dataclass(frozen=True)
class Launch:
    """How each rank starts PROGRAM: a module (-m), an executable as is (--no-python), a Python file
    (--run-path, or a name ending in .py), else an executable looked up on PATH.
    """

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    run_path: bool = False

    def command(self) -> list[str]:
        """The rank's command line; FileNotFoundError (exit 2) when PROGRAM cannot be found."""
        if self.module:
            return [sys.executable, "-m", self.program, *self.args]
        if self.run_path:
            if not Path(self.program).is_file():
                raise FileNotFoundError(f"program {self.program!r} not found (relative to {os.getcwd()})")
            return [sys.executable, self.program, *self.args]
        if self.no_python:
            if not Path(self.program).is_file() and shutil.which(self.program) is None:
                raise FileNotFoundError(f"program {self.program!r} is neither a file nor on PATH")
            return [self.program if os.sep in self.program else (shutil.which(self.program) or self.program),
                    *self.args]  # fmt: skip
        return program_command(self.program, list(self.args))


def say(message: str) -> None:
    sys.stderr.write(f"fdl run: {message}\n")  # one write: lines of concurrent processes never interleave
    sys.stderr.flush()


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


class _Attempt:
    """One attempt's processes: the embedded controller and the local agents serving its world."""

    def __init__(
        self,
        controller: Any,  # noqa: ANN401  api.assemble_controller's Controller
        agents: dict[str, asyncio.subprocess.Process],
        filters: Sequence[asyncio.Future[None]],
    ) -> None:
        self.controller = controller
        self.agents = agents
        self.filters = filters  # --local-ranks-filter: one copy of each agent's output
        self.tasks: list[asyncio.Future[Any]] = []

    def watch(self, events: asyncio.Queue[Any]) -> None:
        """Feed the supervisor each agent's exit and the controller's verdict."""

        async def agent_exit(host: str, agent: asyncio.subprocess.Process) -> None:
            events.put_nowait(api.AgentExited(host, await agent.wait()))

        async def verdict() -> None:
            result = await self.controller.wait()
            cause = result.root_cause.model_dump() if result.root_cause is not None else None
            events.put_nowait(api.verdict_event(result.ok, result.reason, cause))

        self.tasks = [asyncio.ensure_future(agent_exit(h, a)) for h, a in self.agents.items()]
        self.tasks.append(asyncio.ensure_future(verdict()))

    async def collect(self, timeout_s: float) -> None:
        """Give the agents `timeout_s` to exit after the verdict; KILL the rest (their exits are fed)."""
        for agent in self.agents.values():
            if agent.returncode is None:
                try:
                    await asyncio.wait_for(agent.wait(), timeout_s)
                except TimeoutError:
                    agent.kill()

    async def close(self, *, linger: bool = False) -> None:
        """Nothing of this attempt is left: agents killed if still there, controller closed (after a
        moment for a `fdl status --watch` that polled it to see the verdict, with `linger`).
        """
        for agent in self.agents.values():
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if linger:
            await self.controller.linger_for_readers()
        await self.controller.close()
        if self.filters:
            await asyncio.gather(*self.filters)  # the agents are gone: their pipes are at EOF


def _warm_ranks(worker: Any, command: list[str]) -> int:  # noqa: ANN401  a ClusterConfig worker
    """How many warm ranks (flodld.rank.warm) the agent of a local `worker` starts: one per rank when
    its ranks are CPU ranks running a Python script, else none.
    """
    if worker.local_devices == "all" or len(command) < 2 or not command[1].endswith(".py"):
        return 0
    try:
        devices = api.resolve_devices(list(worker.local_devices), cuda_count=0)
    except (ValueError, api.DeviceError):
        return 0
    return len(devices) if all(device.startswith("cpu") for device in devices) else 0


async def _spawn_agents(
    command: list[str], local: list[Any], rank_filter: frozenset[int] | None
) -> list[asyncio.subprocess.Process]:
    """The local agents of one attempt, their spec to follow on stdin; each starts its warm ranks at once."""
    return [
        await asyncio.create_subprocess_exec(
            *api.agent_command(),
            env={
                **os.environ,
                **worker.env,
                api.AGENT_ENV: api.SPEC_ON_STDIN,
                api.WARM_ENV: str(_warm_ranks(worker, command)),
            },
            stdin=asyncio.subprocess.PIPE,
            stdout=None if rank_filter is None else asyncio.subprocess.PIPE,
            limit=OUTPUT_LINE_LIMIT,
        )
        for worker in local
    ]


async def _kill_agents(agents: Sequence[asyncio.subprocess.Process]) -> None:
    for agent in agents:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def _start_attempt(
    command: list[str],
    cluster: api.ClusterConfig,
    local: list[Any],
    overrides: dict[str, Any],
    *,
    restart_count: int,
    max_restarts: int,
    rank_filter: frozenset[int] | None,
    logs: api.RankLogSpec | None = None,
    standby: list[asyncio.subprocess.Process] | None = None,
    on_training: Callable[[], None] | None = None,
    on_formed: Callable[[], None] | None = None,
) -> _Attempt:
    """A fresh world: a new controller run (run id, salt, keys) and the local agents dialing it.

    `standby`: agents started ahead for this attempt (their warm ranks have loaded torch already);
    `on_training` is called once the world trains (when the next attempt's standby may start), `on_formed`
    as it forms.
    """
    # The agents start first, their spec to follow on stdin: their imports overlap the controller's start.
    # The agent is flodld's own process; the program starts only as its ranks (a stock torchrun script works).
    agents = standby if standby is not None else await _spawn_agents(command, local, rank_filter)
    filters = [
        asyncio.ensure_future(_filter_rank_output(agent.stdout, rank_filter))
        for agent in agents
        if rank_filter is not None and agent.stdout is not None
    ]
    try:
        probed = local_devices_counts(cluster)  # every worker here is local
        options = api.ControllerOptions.from_cluster(
            cluster, probed=probed, restart_count=restart_count, max_restarts=max_restarts, **overrides
        )

        def on_phase(phase: Any, reason: str | None) -> None:  # noqa: ANN401  an api phase
            say(f"{phase.value}" + (f" — {reason}" if reason else ""))
            if phase.value in ("forming", "training") and on_formed is not None:
                on_formed()
            if phase.value == "training" and on_training is not None:
                on_training()

        controller = api.assemble_controller(options, on_phase=on_phase)
        _, bound_port = await controller.start()
    except BaseException:
        await _kill_agents(agents)  # never told what to join: they go without a word
        raise
    say(
        f"controller on 127.0.0.1:{bound_port} (run {controller.run_id}); join window open for "
        f"{options.capacity} rank(s); starting {len(local)} local agent(s)"
    )
    pre_shared = controller.join_key != api.OPEN_ADMISSION_KEY
    if logs is not None:
        logs = logs.model_copy(update={"run": logs.run or controller.run_id})
        say(f"rank logs under {api.attempt_dir(logs.dir, logs.run or '', restart_count)}")
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
            logs=logs,
        )
        assert agent.stdin is not None
        agent.stdin.write(api.encode_spec(spec).encode() + b"\n")  # the salt never enters its environment
        with contextlib.suppress(ConnectionError):  # an agent that already died is reported below
            await agent.stdin.drain()
        agent.stdin.close()
    hosts = {worker.host: agent for worker, agent in zip(local, agents, strict=True)}
    return _Attempt(controller, hosts, filters)


class _RunShell:
    """What `api.RunSupervisor` decides, carried out for `fdl run`: the attempt's processes (controller,
    local agents, the next attempt's standby), the supervisor's timers, and the events it is fed.
    One method per action kind (`RUN_ACTIONS`); the rules are all the supervisor's.
    """

    def __init__(
        self,
        command: list[str],
        cluster: api.ClusterConfig,
        local: list[Any],
        overrides: dict[str, Any],
        *,
        rank_filter: frozenset[int] | None,
        logs: api.RankLogSpec | None,
    ) -> None:
        self.command, self.cluster, self.local, self.overrides = command, cluster, local, overrides
        self.rank_filter, self.logs = rank_filter, logs
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.attempt: _Attempt | None = None
        self.collecting: asyncio.Future[None] | None = None
        # With restarts left, the next attempt's agents start once this one trains (not before: their warm
        # ranks' imports would slow this attempt's start) and wait for their spec with torch loaded.
        self.standby: asyncio.Future[list[asyncio.subprocess.Process]] | None = None
        self.earlier: list[Any] = []  # api.EarlierAttempt of each failed attempt (the next ones' state.json)
        self.exit_code: int | None = None

    async def carry_out(self, action: object) -> None:
        handler = RUN_ACTIONS.get(type(action).__name__)
        if handler is None:
            raise AssertionError(f"fdl run has no handler for the supervisor's {action!r}")
        await handler(self, action)

    def _arm_standby(self) -> None:
        if self.standby is None:
            self.standby = asyncio.ensure_future(_spawn_agents(self.command, self.local, self.rank_filter))

    async def _start(self, action: Any) -> None:  # noqa: ANN401  api.StartAttempt
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        if self.attempt is not None:
            if self.attempt.controller.result is not None:  # state.json's attempt.earlier
                record = self.attempt.controller.run_record()
                self.earlier.append(api.EarlierAttempt.of(record, action.restart_count))
                self.overrides["earlier_attempts"] = tuple(self.earlier)
            await self.attempt.close()
        ready, self.standby = (await self.standby if self.standby is not None else None), None
        self.attempt = await _start_attempt(
            self.command, self.cluster, self.local, self.overrides,
            restart_count=action.restart_count, max_restarts=action.max_restarts,
            rank_filter=self.rank_filter, logs=self.logs, standby=ready,
            on_training=self._arm_standby if action.restart_count < action.max_restarts else None,
            on_formed=lambda: self.events.put_nowait(api.WorldFormed()),
        )  # fmt: skip
        if self.logs is not None and self.logs.run is None:  # the run's directory: its first attempt's id
            self.logs = self.logs.model_copy(update={"run": self.attempt.controller.run_id})
        self.attempt.watch(self.events)

    async def _stop(self, action: Any) -> None:  # noqa: ANN401  api.StopAttempt
        assert self.attempt is not None
        await self.attempt.controller.stop(action.reason)

    async def _arm_timer(self, action: Any) -> None:  # noqa: ANN401  api.ArmTimer
        if action.name in self.timers:
            self.timers[action.name].cancel()
        expired = api.TimerExpired(action.name)
        loop = asyncio.get_running_loop()
        self.timers[action.name] = loop.call_later(action.seconds, self.events.put_nowait, expired)

    async def _collect(self, action: Any) -> None:  # noqa: ANN401  api.CollectAgents
        assert self.attempt is not None
        self.collecting = asyncio.ensure_future(self.attempt.collect(action.timeout_s))

    async def _say(self, action: Any) -> None:  # noqa: ANN401  api.Say
        say(action.message)

    async def _finish(self, action: Any) -> None:  # noqa: ANN401  api.Finish
        if self.attempt is not None:
            await self.attempt.close(linger=True)
            self.attempt = None
        say(action.summary)
        self.exit_code = int(action.exit_code)

    async def close(self) -> None:
        """Nothing of the run is left: timers, the attempt's processes, an unused standby."""
        for timer in self.timers.values():
            timer.cancel()
        if self.collecting is not None:
            self.collecting.cancel()
        if self.attempt is not None:
            await self.attempt.close()
        if self.standby is not None:  # never needed: they and their warm ranks go
            await _kill_agents(await self.standby)


RUN_ACTIONS: dict[str, Callable[[_RunShell, Any], Awaitable[None]]] = {
    "StartAttempt": _RunShell._start,
    "StopAttempt": _RunShell._stop,
    "ArmTimer": _RunShell._arm_timer,
    "CollectAgents": _RunShell._collect,
    "Say": _RunShell._say,
    "Finish": _RunShell._finish,
}
"""The supervisor's action kinds (by class name: `api` loads them lazily) -> the shell's handler."""


async def run_job(
    command: list[str],
    cluster: api.ClusterConfig,
    *,
    port: int | None = None,
    join_timeout: float | None = None,
    rank_filter: frozenset[int] | None = None,
    max_restarts: int | None = None,
    logs: api.RankLogSpec | None = None,
) -> int:
    """Run `command` on the local workers of `cluster`, restarting a failed attempt up to `max_restarts`
    times (default: `controller.join.max_restarts`); the rules are `api.RunSupervisor`'s. With `logs`
    the local agents write per-rank log files, every attempt's under the first attempt's run id.
    """
    overrides: dict[str, Any] = {"preshared": True}  # local agents get the salt in their environment
    if port is not None:
        overrides["port"] = port
    if join_timeout is not None:  # torchrun's --rdzv-conf join_timeout=SECS
        overrides["join"] = cluster.controller.join.model_copy(update={"join_timeout": join_timeout})
    if cluster.controller.host in ("127.0.0.1", "localhost"):
        overrides["bind_host"] = "127.0.0.1"
    local = [worker for worker in cluster.workers if worker.is_local(cluster.controller.host)]
    bound = cluster.controller.join.max_restarts if max_restarts is None else max_restarts
    supervisor = api.RunSupervisor([worker.host for worker in local], max_restarts=bound)
    shell = _RunShell(command, cluster, local, overrides, rank_filter=rank_filter, logs=logs)
    loop = asyncio.get_running_loop()
    interrupted = api.Interrupted("interrupted by the operator")
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, shell.events.put_nowait, interrupted)
    try:
        actions = list(supervisor.start())
        while True:
            for action in actions:
                await shell.carry_out(action)
                if shell.exit_code is not None:
                    return shell.exit_code
            actions = supervisor.handle(await shell.events.get())
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await shell.close()


OUTPUT_LINE_LIMIT = 1024 * 1024
"""The longest output line read whole from a local agent; a longer one is passed on in pieces."""

_RANK_PREFIX = re.compile(rb"^\[[^\]]*:r(\d+)\] ")  # the agent's '[host:device:rN] ' before a rank's line


async def _filter_rank_output(stream: asyncio.StreamReader, keep: frozenset[int]) -> None:
    """Copy an agent's output to ours, leaving out the lines of ranks not in `keep` (--local-ranks-filter)."""
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over OUTPUT_LINE_LIMIT: pass on what is buffered, unfiltered
            line = await stream.read(OUTPUT_LINE_LIMIT)
        if not line:
            return
        match = _RANK_PREFIX.match(line)
        if match is None or int(match[1]) in keep:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="fdl run: controller: %(message)s")
    try:
        program, program_args = split_program(list(args.rest))
        if program is None:
            raise ValueError("no program given: fdl run [OPTIONS] PROGRAM [ARGS...]")
        args.program = program
        torchrun = torchrun_plan(args)
        bounds = _window_bounds(args, torchrun)
        launch = Launch(program, tuple(program_args), args.module, args.no_python, args.run_path)
        command = launch.command()
        if torchrun.walk_in is not None:
            return _walk_in(args, torchrun, command)
        cluster, plan = plan_run(args)
        logs = resolve_logs(
            log_dir=args.log_dir, redirects=args.redirects, tee=args.tee,
            block=config_logs(args.project, getattr(args, "env", None)), say=say,
        )  # fmt: skip
        if bounds is not None:
            join = cluster.controller.join.model_copy(
                update={"min_rank_start": bounds[0], "target_ranks": bounds[1]}
            )
            controller = cluster.controller.model_copy(update={"join": join})
            cluster = cluster.model_copy(update={"controller": controller})
            plan += f"; --nnodes: quorum {bounds[0]}, target {bounds[1]} rank(s)"
    except (FileNotFoundError, ValueError) as error:
        say(str(error))
        return EXIT_USAGE
    for note in torchrun.notes:
        say(note)
    say(f"starting {plan}")
    # Plain asyncio: the controller's mux checks for asyncio.Transport, which uvloop's transports are not.
    if any(not worker.is_local(cluster.controller.host) for worker in cluster.workers):
        if launch.module or launch.no_python or launch.run_path or torchrun.rank_filter is not None:
            say(
                "-m/--no-python/--run-path/--local-ranks-filter: not yet with remote workers (the fan-out "
                "starts PROGRAM by name and prints every rank)"
            )
            return EXIT_USAGE
        if logs is not None:
            say(
                "--log-dir/--redirects/--tee (logs: in fdl.yml): not yet with remote workers (the fan-out "
                "prints every rank); walk them in with `fdl join --log-dir DIR` instead, or drop the flags"
            )
            return EXIT_USAGE
        # cluster_run loads asyncssh: only when there is a remote worker.
        fanout = api.run_cluster_job(
            program, program_args, cluster, port=args.port, max_restarts=torchrun.max_restarts
        )
        return asyncio.run(fanout)
    job = run_job(
        command,
        cluster,
        port=args.port,
        join_timeout=torchrun.join_timeout,
        rank_filter=torchrun.rank_filter,
        max_restarts=torchrun.max_restarts,
        logs=logs,
    )
    return asyncio.run(job)


def _window_bounds(args: argparse.Namespace, torchrun: TorchrunPlan) -> tuple[int, int] | None:
    """--nnodes MIN:MAX over more than one host, as the window's quorum and target in ranks (MIN and MAX
    times --nproc-per-node N, torchrun's ranks per host); only with a cluster: block, whose walk-ins
    make the hosts. None when --nnodes allows one host. ValueError (exit 2) says what is missing.
    """
    if torchrun.nnodes is None:
        return None
    low, high = torchrun.nnodes
    if _project_cluster(args) is None:
        raise ValueError(
            f"--nnodes {low}:{high}: fdl run's embedded controller serves this host only. For a world of "
            "several hosts give fdl.yml a cluster: block (controller.join.discovery and a token), run "
            "`fdl @cluster run --nnodes MIN:MAX --nproc-per-node N PROGRAM` here and `fdl join HOST:PORT "
            "--bin PROGRAM` (or fdl run --rdzv-endpoint HOST:PORT PROGRAM) on the others"
        )
    per_host = (args.nproc_per_node or "").strip()
    if not per_host.isdigit() or int(per_host) < 1:
        raise ValueError(
            f"--nnodes {low}:{high} counts hosts and the join window counts ranks: give --nproc-per-node N "
            "(ranks per host, a number) to make the bounds MIN x N and MAX x N ranks, or set "
            "controller.join.min_rank_start/target_ranks in fdl.yml"
        )
    args.nproc_per_node = None  # it sized the bounds; the cluster: block's workers list their own ranks
    return low * int(per_host), high * int(per_host)


def _walk_in(args: argparse.Namespace, torchrun: TorchrunPlan, command: list[str]) -> int:
    """--rdzv-endpoint (or --master-addr with --node-rank >= 1): run as `fdl join HOST:PORT` would, the
    rank flags sizing this host and PROGRAM (as -m/--no-python/--run-path say) as the ranks' command.
    """
    assert torchrun.walk_in is not None
    host, port = torchrun.walk_in
    if args.port is not None or torchrun.join_timeout is not None:
        say("--port and --rdzv-conf set an embedded controller's; walking in, they are the controller's own")
        return EXIT_USAGE
    devices = None
    if any(getattr(args, name, None) is not None for name in ("devices", "nproc_per_node", "ranks")):
        local = choose_local_ranks(devices=args.devices, nproc_per_node=args.nproc_per_node, ranks=args.ranks)
        devices = ",".join(local.entries)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    walk = argparse.Namespace(
        project=args.project, env=getattr(args, "env", None), controller=address, token=None,
        program=sys.executable,  # checked by fdl join; the ranks' command is `command`, set below
        program_args=[], devices=devices, host=None, persist=None, ssh=None, identity=None, accept_env=None,
        log_dir=args.log_dir, redirects=args.redirects, tee=args.tee,
    )  # fmt: skip
    try:
        plan = join.resolve_plan(walk)
    except join.UsageError as error:
        say(str(error))
        return EXIT_USAGE
    plan = dataclasses.replace(plan, spec=plan.spec.model_copy(update={"program": command}))
    for note in torchrun.notes:
        say(note)
    say(f"walking in to the controller at {host}:{port} (as fdl join)")
    try:
        return join.join_loop(plan)
    except (KeyboardInterrupt, join.Stopped):
        say("stopped")
        return join.EXIT_TRANSIENT


COMMAND = Command("run", "run a program on every rank (controller embedded)", __doc__, configure_parser, main)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
