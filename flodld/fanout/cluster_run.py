"""`fdl @cluster run` with remote workers: controller embedded, local agents, fan-out agents.

Order: probe `local_devices: all` hosts (capacity must be known before the window opens), then
attempt by attempt: start the controller, start local agents as subprocesses and remote agents
over SSH, and feed what happens to the run supervisor (`flodld.membership.supervisor`), whose rules
are the same as `fdl run`'s: an agent that exits before the world forms, a lost SSH session, an
interrupt. With `max_restarts`, a failed attempt is torn down on every host (each SSH session
closed, so its remote supervisor TERMs then KILLs the agent's process group, ranks included) and
the next one is launched afresh: a new controller run on the same port (run id, salt, keys) and a
new SSH session per host. On any exit (done, failure, Ctrl-C, SIGTERM, cancellation) every agent
is stopped before this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flodld.agent.spawn import agent_command
from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.config.models import ClusterConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.service import assemble_controller
from flodld.fanout.drive import drive_run
from flodld.fanout.launcher import AgentExit, FanOut, FanOutError, plan_agent, probe_device_count, workdir_for
from flodld.fanout.localagent import stop_local_agent
from flodld.membership.phase import Phase
from flodld.membership.snapshot import EarlierAttempt
from flodld.membership.supervisor import (
    Action,
    AgentExited,
    ArmTimer,
    CollectAgents,
    Event,
    Finish,
    HostLost,
    RunSupervisor,
    Say,
    StartAttempt,
    StopAttempt,
    TimerExpired,
    WorldFormed,
    keeps_links,
    verdict_event,
)
from flodld.wire.salt import OPEN_ADMISSION_KEY

if TYPE_CHECKING:
    from flodld.controller.run import Controller

EXIT_DONE, EXIT_FAILED = 0, 1
# Forwarded to remote agents so a scaled-down test or a slow link behaves the same on every host.
PASSED_VARIABLES = ("FLODL_NET_TIMEOUT_SCALE",)


def has_remote_workers(cluster: ClusterConfig) -> bool:
    return any(not worker.is_local(cluster.controller.host) for worker in cluster.workers)


def _print_line(host: str, line: str) -> None:
    print(f"[{host}] {line}", flush=True)


async def probe_all_devices(cluster: ClusterConfig, local_cwd: str) -> dict[str, int]:
    """Device counts of every `local_devices: all` worker; remote ones over SSH, in parallel."""
    counts: dict[str, int] = {}
    remote = []
    for host in cluster.hosts_to_probe:
        worker = cluster.worker(host)
        assert worker is not None
        if worker.is_local(cluster.controller.host):
            import torch  # only to count local CUDA devices: `fdl` itself never loads torch

            counts[host] = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if counts[host] == 0:
                raise FanOutError(
                    host, "local_devices: all found no CUDA device; list CPU ranks (e.g. [cpu:2])"
                )
        else:
            remote.append(worker)
    found = await asyncio.gather(
        *(probe_device_count(w, workdir_for(w, cluster.controller, local_cwd)) for w in remote)
    )
    counts.update({worker.host: count for worker, count in zip(remote, found, strict=True)})
    return counts


async def run_cluster_job(
    program: str,
    args: Sequence[str],
    cluster: ClusterConfig,
    *,
    port: int | None = None,
    max_restarts: int | None = None,
    say: Callable[[str], None] = lambda message: print(f"fdl run: {message}", file=sys.stderr, flush=True),
    on_output: Callable[[str, str], None] = _print_line,
    environ: Mapping[str, str] | None = None,
    grace_s: int = 10,
) -> int:
    """Run `program args` on every worker of `cluster`, restarting a failed attempt up to `max_restarts`
    times (default `controller.join.max_restarts`); returns 0 when the run is done, else 1.
    """
    env = dict(os.environ if environ is None else environ)
    local_cwd = os.getcwd()
    try:
        probed = await probe_all_devices(cluster, local_cwd)
    except FanOutError as error:
        say(f"run FAILED before the window opened: {error}")
        return EXIT_FAILED
    # preshared: every agent this launcher starts gets the salt over its own channel (SSH stdin, or the
    # environment of a local child), so a loopback bind (all workers tunneled) never opens admission:
    # a local user on a worker host cannot join through the -R forward without the salt.
    overrides: dict[str, Any] = {"preshared": True} if port is None else {"preshared": True, "port": port}
    bound = cluster.controller.join.max_restarts if max_restarts is None else max_restarts
    supervisor = RunSupervisor([worker.host for worker in cluster.workers], max_restarts=bound)
    shell = _FanOutShell(
        program, args, cluster, probed, overrides, say=say, on_output=on_output, env=env, grace_s=grace_s,
        local_cwd=local_cwd,
    )  # fmt: skip
    return await drive_run(supervisor, shell)


def supervisor_code(code: int) -> int:
    """A remote agent's exit status as the supervisor reads codes: the bash supervisor reports an agent
    killed by signal N as 128+N, which is -N here (as subprocess reports a local one); others as they are.
    """
    return -(code - 128) if 128 < code < 160 else code


class _FanOutShell:
    """What the run supervisor decides, carried out for the fan-out: per attempt a controller, the local
    agents and one SSH session per remote worker; the timers; the events fed back. One method per action
    kind (`FANOUT_ACTIONS`); the rules are all the supervisor's.
    """

    def __init__(
        self,
        program: str,
        args: Sequence[str],
        cluster: ClusterConfig,
        probed: Mapping[str, int],
        overrides: dict[str, Any],
        *,
        say: Callable[[str], None],
        on_output: Callable[[str, str], None],
        env: dict[str, str],
        grace_s: int,
        local_cwd: str,
    ) -> None:
        self.program, self.args, self.cluster, self.probed = program, list(args), cluster, probed
        self.overrides = overrides
        self.say, self.on_output, self.env = say, on_output, env
        self.grace_s, self.local_cwd = grace_s, local_cwd
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.generation = 0  # events of an earlier attempt are dropped
        self.controller: Controller | None = None
        self.fanout: FanOut | None = None
        self.local_agents: dict[str, asyncio.subprocess.Process] = {}
        self.watchers: list[asyncio.Task[None]] = []
        self.collecting: asyncio.Task[None] | None = None
        self.earlier: list[EarlierAttempt] = []
        self.exit_code: int | None = None
        self.kept: frozenset[str] = frozenset()  # hosts that answered Reform: their agents are not collected

    async def carry_out(self, action: Action) -> None:
        handler = FANOUT_ACTIONS.get(type(action))
        if handler is None:
            raise AssertionError(f"the fan-out has no handler for the supervisor's {action!r}")
        await handler(self, action)

    def _feed(self, generation: int) -> Callable[[Event], None]:
        def feed(event: Event) -> None:
            if generation == self.generation:
                self.events.put_nowait(event)

        return feed

    async def _start(self, action: StartAttempt) -> None:
        self.generation += 1  # first: whatever the previous attempt's teardown reports is not this one's
        feed = self._feed(self.generation)
        # A restart that keeps the links (docs/restarts.md): the kept hosts' SSH sessions and local agents
        # go on, the port is handed to the next controller with their links on it.
        kept_hosts = frozenset(action.kept)
        kept_links = self.controller.take_kept_links() if self.controller is not None and kept_hosts else []
        kept_links = [link for link in kept_links if link.host in kept_hosts]
        kept_hosts = frozenset(link.host for link in kept_links)
        old_fanout = self.fanout
        kept_local = {host: p for host, p in self.local_agents.items() if host in kept_hosts}
        lent = await self._end_attempt(keep=kept_hosts)
        overrides = {**self.overrides, "earlier_attempts": tuple(self.earlier)}
        options = ControllerOptions.from_cluster(
            self.cluster, probed=self.probed, restart_count=action.restart_count,
            max_restarts=action.max_restarts, **overrides,
        )  # fmt: skip

        def on_phase(phase: Phase, reason: str | None) -> None:
            self.say(phase.value + (f" — {reason}" if reason else ""))
            if phase in (Phase.FORMING, Phase.TRAINING):
                feed(WorldFormed())

        mux, address = lent if lent is not None else (None, None)
        controller = assemble_controller(options, on_phase=on_phase, mux=mux, address=address)
        try:
            bind, bound_port = await controller.start()
            if lent is not None:
                await controller.take_over_port()
                controller.adopt(kept_links)  # the re-formation window: kept hosts are re-admitted at once
            controller.keep_links = keeps_links(action.restart_count, action.max_restarts)
        except OSError as error:
            await controller.close()
            self.say(
                f"run FAILED: the controller cannot listen on {options.effective_bind_host}:{options.port} "
                f"({error}); free the port or set cluster.controller.port"
            )
            self.exit_code = EXIT_FAILED
            return
        self.controller = controller
        self.overrides["port"] = bound_port  # every attempt on this port (status readers, tunnels' target)
        # Always the salt, unless the operator set open_admission explicitly (then the join key is public,
        # the controller warns, and agents receive the salt in Accept like any joiner).
        salt_hex = controller.salt_hex if controller.join_key != OPEN_ADMISSION_KEY else None
        here = self.cluster.controller.host
        local = [w for w in self.cluster.workers if w.is_local(here)]
        remote = [w for w in self.cluster.workers if not w.is_local(here)]
        self.say(f"controller bound to {bind}:{bound_port} (run {controller.run_id}); window for "
                 f"{options.capacity} rank(s); {len(local)} local agent(s), {len(remote)} fan-out agent(s) "
                 f"({sum(w.tunnel for w in remote)} tunneled)")  # fmt: skip
        self.watchers.append(asyncio.ensure_future(self._verdict(controller, feed)))
        passed = {name: self.env[name] for name in PASSED_VARIABLES if name in self.env}
        plans = [
            plan_agent(w, self.cluster, program=self.program, args=self.args, controller_port=bound_port,
                       salt_hex=salt_hex, extra_env=passed, local_cwd=self.local_cwd)
            for w in remote if w.host not in kept_hosts
        ]  # fmt: skip
        for host, process in kept_local.items():  # kept linked: the same agent serves this attempt
            self.local_agents[host] = process
            self.watchers.append(asyncio.ensure_future(_local_exit(host, process, feed)))
        for worker in local:
            if worker.host in kept_hosts:
                continue
            spec = AgentSpec(
                host=worker.host, controller_host="127.0.0.1", controller_port=bound_port, salt_hex=salt_hex,
                devices=list(worker.local_devices) if worker.local_devices != "all" else ["all"],
                averaging=options.averaging, cluster_env=True, host_env=worker.rank_env() or None,
                program=[sys.executable, self.program, *self.args],
            )  # fmt: skip
            process = await asyncio.create_subprocess_exec(
                *agent_command(), env={**self.env, **worker.env, AGENT_ENV: encode_spec(spec)},
                stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            self.local_agents[worker.host] = process
            self.watchers.append(asyncio.ensure_future(_local_exit(worker.host, process, feed)))

        def on_exit(gone: AgentExit) -> None:
            if gone.lost:
                feed(HostLost(gone.host, f"SSH session to host {gone.host!r} lost (keepalives unanswered)"))
            else:
                feed(AgentExited(gone.host, supervisor_code(gone.code)))

        self.fanout = FanOut(plans, on_output=self.on_output, grace_s=self.grace_s, on_exit=on_exit)
        if old_fanout is not None and kept_hosts:
            old_fanout.hand_over(kept_hosts, self.fanout)  # their SSH sessions go on, as this attempt's
        with contextlib.suppress(FanOutError):  # each host that could not be started is reported below
            # At a restart the hosts that were started keep running: the supervisor leaves an unreachable
            # one out when others are there (the window forms without it if the quorum allows).
            await self.fanout.start(keep_started=action.restart_count > 0)
        for host, failure in self.fanout.failed.items():
            feed(HostLost(host, str(failure)))

    async def _verdict(self, controller: Controller, feed: Callable[[Event], None]) -> None:
        result = await controller.wait()
        cause = result.root_cause.model_dump() if result.root_cause is not None else None
        self.kept = frozenset(controller.kept)  # answered Reform: linked, for the next attempt
        feed(verdict_event(result.ok, result.reason, cause, tuple(self.kept)))

    async def _stop(self, action: StopAttempt) -> None:
        controller = self.controller
        if controller is None:
            return
        if not action.keep_links:  # an interrupt: Abort the hosts, never Reform
            controller.keep_links = False
        if controller.keep_links:  # the verdict comes through _verdict; the port outlives this attempt
            controller.abort(action.reason)
            return
        await controller.stop(action.reason)

    async def _arm_timer(self, action: ArmTimer) -> None:
        if action.name in self.timers:
            self.timers[action.name].cancel()
        self.timers[action.name] = asyncio.get_running_loop().call_later(
            action.seconds, self.events.put_nowait, TimerExpired(action.name)
        )

    async def _collect(self, action: CollectAgents) -> None:
        self.collecting = asyncio.ensure_future(self._collect_within(action.timeout_s))

    async def _collect_within(self, timeout_s: float) -> None:
        """The agents get `timeout_s` to exit after the verdict; then every SSH session is closed (the remote
        supervisor TERMs, then KILLs, the agent's group) and the local ones are killed. Exits are fed.
        """
        kept = self.kept
        waits: list[Awaitable[Any]] = [p.wait() for h, p in self.local_agents.items() if h not in kept]
        if self.fanout is not None:
            waits += [a.process.wait_closed() for h, a in self.fanout.agents.items() if h not in kept]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), timeout_s)
        await self._stop_agents(keep=kept)

    async def _say(self, action: Say) -> None:
        self.say(action.message)

    async def _finish(self, action: Finish) -> None:
        await self._end_attempt()
        self.say(action.summary)
        self.exit_code = action.exit_code

    async def _stop_agents(self, keep: frozenset[str] = frozenset()) -> None:
        """Stop the attempt's agents, all but those of `keep` (kept linked for the next attempt)."""
        if self.fanout is not None:
            await self.fanout.stop(keep=keep)
        for host, process in self.local_agents.items():
            if host not in keep:
                await stop_local_agent(process, self.grace_s)

    async def _end_attempt(self, keep: frozenset[str] = frozenset()) -> tuple[Any, tuple[str, int]] | None:
        """Nothing of the current attempt is left: timers, agents on every host, its controller. With `keep`
        (hosts kept linked for the next attempt) their agents stay and the port is released, not closed:
        returns its mux and address for the next controller.
        """
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        if self.collecting is not None:
            self.collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.collecting
            self.collecting = None
        await self._stop_agents(keep)
        for watcher in self.watchers:
            watcher.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        self.watchers = []
        controller, self.controller, self.fanout, self.local_agents = self.controller, None, None, {}
        self.kept = frozenset()
        lent = None
        if controller is not None:
            if controller.result is not None:  # state.json's attempt.earlier, for the next attempt
                self.earlier.append(EarlierAttempt.of(controller.run_record(), len(self.earlier) + 1))
            if keep:
                lent = await controller.release_port()
            await controller.close()
        return lent

    async def close(self) -> None:
        await self._end_attempt()


FANOUT_ACTIONS: dict[type, Callable[[_FanOutShell, Any], Awaitable[None]]] = {
    StartAttempt: _FanOutShell._start,
    StopAttempt: _FanOutShell._stop,
    ArmTimer: _FanOutShell._arm_timer,
    CollectAgents: _FanOutShell._collect,
    Say: _FanOutShell._say,
    Finish: _FanOutShell._finish,
}
"""The supervisor's action kinds -> the fan-out shell's handler."""


async def _local_exit(host: str, process: asyncio.subprocess.Process, feed: Callable[[Event], None]) -> None:
    feed(AgentExited(host, await process.wait()))
