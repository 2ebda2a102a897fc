"""`fdl run`'s local-agent shell: each attempt's embedded controller and local agents, carrying out what
`api.RunSupervisor` decides (`run_job`), and the --local-ranks-filter copy of the agents' output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fdl.runplan import local_devices_counts
from flodld import api


def say(message: str) -> None:
    sys.stderr.write(f"fdl run: {message}\n")  # one write: lines of concurrent processes never interleave
    sys.stderr.flush()


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
            kept = tuple(self.controller.kept)  # hosts that answered Reform: linked, for the next attempt
            events.put_nowait(api.verdict_event(result.ok, result.reason, cause, kept))

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

    async def close(self, *, linger: bool = False, keep: frozenset[str] = frozenset()) -> None:
        """Nothing of this attempt is left: agents killed if still there, controller closed (after a
        moment for a `fdl status --watch` that polled it to see the verdict, with `linger`). `keep`: hosts
        whose agents stay linked for the next attempt (a restart that keeps the links), left running.
        """
        for host, agent in self.agents.items():
            if agent.returncode is None and host not in keep:
                agent.kill()
                await agent.wait()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if linger:
            await self.controller.linger_for_readers()
        await self.controller.close()
        if self.filters and not keep:
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


def _forkable(worker: Any, command: list[str]) -> int:  # noqa: ANN401  a ClusterConfig worker
    """How many CPU ranks of a local `worker` a fork server could fork: its warm ranks, unless its `env:`
    sets a variable read when torch loads (0: none).
    """
    return 0 if api.startup_variables(worker.env) else _warm_ranks(worker, command)


class _Forks:
    """The run's fork server (flodld.agent.forkserver): one `import torch` for the CPU ranks of every local
    agent of every attempt, instead of one per rank. It serves the agents whose ranks number what it was
    started for and whose `env:` sets no start-up variable; the others keep their warm ranks.
    """

    def __init__(self, command: list[str], local: list[Any]) -> None:
        fitting = [count for worker in local if (count := _forkable(worker, command))]
        self.ranks = max(set(fitting), key=fitting.count) if fitting else 0
        self.directory = tempfile.mkdtemp(prefix="fdl-run-forks-") if self.ranks else None
        self.server: api.HostForkServer | None = None
        if self.directory is not None:
            try:
                self.server = api.HostForkServer.start([f"cpu:{self.ranks}"], self.directory, os.environ)
            except OSError as error:
                say(f"fork server not started, ranks start warm: {error}")

    def serves(self, worker: Any, command: list[str]) -> bool:  # noqa: ANN401  a ClusterConfig worker
        return self.server is not None and _forkable(worker, command) == self.ranks

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


async def _spawn_agents(
    command: list[str], local: list[Any], rank_filter: frozenset[int] | None, forks: _Forks | None = None
) -> list[asyncio.subprocess.Process]:
    """The local agents of one attempt, their spec to follow on stdin; each starts its warm ranks at once,
    or is told the run's fork server.
    """

    def roles(worker: Any) -> dict[str, str]:  # noqa: ANN401  a ClusterConfig worker
        if forks is not None and forks.server is not None and forks.serves(worker, command):
            return {api.FORK_SERVER_ENV: forks.server.path}
        return {api.WARM_ENV: str(_warm_ranks(worker, command))}

    return [
        await asyncio.create_subprocess_exec(
            *api.agent_command(),
            env={
                **os.environ,
                **worker.env,
                api.AGENT_ENV: api.SPEC_ON_STDIN,
                **roles(worker),
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
    on_formed: Callable[[], None] | None = None,
    kept: _Kept | None = None,
    forks: _Forks | None = None,
) -> _Attempt:
    """A fresh world: a new controller run (run id, salt, keys) and the local agents dialing it.

    `kept`: what the attempt before left linked (a restart that keeps the links): its port, its kept hosts'
    links and agents; agents are started only for the other hosts. `on_formed` is called as the world forms.
    """
    # The agents start first, their spec to follow on stdin: their imports overlap the controller's start.
    # The agent is flodld's own process; the program starts only as its ranks (a stock torchrun script works).
    # Hosts kept linked from the attempt before need none: their agents serve this attempt too.
    kept_agents = kept.agents if kept is not None else {}
    launch = [worker for worker in local if worker.host not in kept_agents]
    agents = await _spawn_agents(command, launch, rank_filter, forks)
    filters: list[asyncio.Future[None]] = [
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

        if kept is None:
            controller = api.assemble_controller(options, on_phase=on_phase)
            _, bound_port = await controller.start()
        else:  # the port the attempt before released, its kept links still on it
            controller = api.assemble_controller(
                options, on_phase=on_phase, mux=kept.mux, address=kept.address
            )
            _, bound_port = await controller.start()
            await controller.take_over_port()
            controller.adopt(kept.links)  # the re-formation window: the kept hosts are re-admitted at once
        controller.keep_links = api.keeps_links(restart_count, max_restarts)
    except BaseException:
        await _kill_agents(agents)  # never told what to join: they go without a word
        raise
    say(
        f"controller on 127.0.0.1:{bound_port} (run {controller.run_id}); join window open for "
        f"{options.capacity} rank(s); starting {len(launch)} local agent(s)"
    )
    pre_shared = controller.join_key != api.OPEN_ADMISSION_KEY
    if logs is not None:
        logs = logs.model_copy(update={"run": logs.run or controller.run_id})
        say(f"rank logs under {api.attempt_dir(logs.dir, logs.run or '', restart_count)}")
    for worker, agent in zip(launch, agents, strict=True):
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
    hosts = {**kept_agents, **{worker.host: agent for worker, agent in zip(launch, agents, strict=True)}}
    if kept is not None:
        filters = [*kept.filters, *filters]  # the kept agents' output copies go on
    return _Attempt(controller, hosts, filters)


class _Kept:
    """What a restart that keeps the links carries to the next attempt: the released port (mux and address),
    the links of the hosts that answered Reform, their agents and their output copies.
    """

    def __init__(
        self,
        mux: Any,  # noqa: ANN401  the controller's PortMux
        address: tuple[str, int],
        links: list[Any],
        agents: dict[str, asyncio.subprocess.Process],
        filters: Sequence[asyncio.Future[None]],
    ) -> None:
        self.mux, self.address, self.links, self.agents, self.filters = mux, address, links, agents, filters


class _RunShell:
    """What `api.RunSupervisor` decides, carried out for `fdl run`: the attempt's processes (controller,
    local agents), the supervisor's timers, and the events it is fed.
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
        forks: _Forks | None = None,
    ) -> None:
        self.command, self.cluster, self.local, self.overrides = command, cluster, local, overrides
        self.rank_filter, self.logs, self.forks = rank_filter, logs, forks
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.attempt: _Attempt | None = None
        self.collecting: asyncio.Future[None] | None = None
        self.earlier: list[Any] = []  # api.EarlierAttempt of each failed attempt (the next ones' state.json)
        self.exit_code: int | None = None

    async def carry_out(self, action: object) -> None:
        handler = RUN_ACTIONS.get(type(action).__name__)
        if handler is None:
            raise AssertionError(f"fdl run has no handler for the supervisor's {action!r}")
        await handler(self, action)

    async def _start(self, action: Any) -> None:  # noqa: ANN401  api.StartAttempt
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        kept: _Kept | None = None
        if self.attempt is not None:
            if self.attempt.controller.result is not None:  # state.json's attempt.earlier
                record = self.attempt.controller.run_record()
                self.earlier.append(api.EarlierAttempt.of(record, action.restart_count))
                self.overrides["earlier_attempts"] = tuple(self.earlier)
            old = self.attempt
            links = [link for link in old.controller.take_kept_links() if link.host in action.kept]
            if links:  # the hosts stay linked: the port stays up for the next attempt's window
                mux, address = await old.controller.release_port()
                hosts = frozenset(link.host for link in links)
                agents = {host: agent for host, agent in old.agents.items() if host in hosts}
                kept = _Kept(mux, address, links, agents, old.filters)
                await old.close(keep=hosts)
            else:
                await old.close()
        self.attempt = await _start_attempt(
            self.command, self.cluster, self.local, self.overrides,
            restart_count=action.restart_count, max_restarts=action.max_restarts,
            rank_filter=self.rank_filter, logs=self.logs,
            on_formed=lambda: self.events.put_nowait(api.WorldFormed()), kept=kept, forks=self.forks,
        )  # fmt: skip
        if self.logs is not None and self.logs.run is None:  # the run's directory: its first attempt's id
            self.logs = self.logs.model_copy(update={"run": self.attempt.controller.run_id})
        self.attempt.watch(self.events)

    async def _stop(self, action: Any) -> None:  # noqa: ANN401  api.StopAttempt
        assert self.attempt is not None
        controller = self.attempt.controller
        if not action.keep_links:  # an interrupt: Abort the hosts, never Reform
            controller.keep_links = False
        if controller.keep_links:  # the verdict comes through watch(); the port must outlive this attempt
            controller.abort(action.reason)
            return
        await controller.stop(action.reason)

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
        """Nothing of the run is left: timers, the attempt's processes."""
        for timer in self.timers.values():
            timer.cancel()
        if self.collecting is not None:
            self.collecting.cancel()
        if self.attempt is not None:
            await self.attempt.close()


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
    forks = _Forks(command, local)
    try:
        shell = _RunShell(command, cluster, local, overrides, rank_filter=rank_filter, logs=logs, forks=forks)
        return await api.drive_run(supervisor, shell)
    finally:
        await asyncio.to_thread(forks.close)  # after the agents: any rank still running goes with it


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
