"""The agent process: its host's own shell, and a walk-in shell for each slot that heals in.

`run_agent` is the agent role's entry. It runs the host's shell (flodld/agent/run.py: join, spawn,
supervise), owns the signals, and in a run that grows turns each freed slot (ReportRankExit.frees_slot) into a
walk-in of its own, `HOST+N`, as `flodld.agent.heal` decides (docs/elastic-averaging.md, "Slots heal in
place"). While the host's own relay serves the run, the slot asks to ride it (Hello.rides): its rank then
dials that relay and no relay of its own starts.

Lifetimes:
- a signal tears every shell down (each gets Interrupted);
- once the host's own shell has finished, healing goes on only while the host is still in its run: its own
  shell lost every rank and the run went on, and a healed slot still trains in it. Otherwise (the run is
  over, aborted, the host torn down or its link lost; or nothing of the host trains any more) no slot heals,
  and a walk-in shell that has not formed yet is interrupted: it would otherwise join the next run beside
  the host's own re-dial (`fdl join --persist` dials at once after a host that lost every rank). A walk-in
  that formed lives on as the member it is, until its run ends for it;
- a walk-in shell serves only the run its host was in: formed into another (a race with the run's end), it
  leaves at once;
- the process exits once every shell has, with the host's own shell's code (the one its starter reads, with
  the mark file: clients/fdl/join.py). A walk-in shell writes no mark.
- an agent killed outright takes its walk-in shells with it: they are coroutines of this process, and their
  children die with it as the host's own do (PDEATHSIG, the fork server's closed connection).
- the host's relay outlives the host's own ranks while healed slots ride it: its shell stops it only once
  every riding slot is done (`_riders_done`).
"""

from __future__ import annotations

import asyncio
import os
import signal

from flodld.agent import supervision as sv
from flodld.agent.children import say
from flodld.agent.forkserver import ForkServer
from flodld.agent.heal import SlotHeals, SlotStaysEmpty
from flodld.agent.join import ExitClass
from flodld.agent.run import AgentShell
from flodld.agent.spec import AgentSpec, DeviceError, agent_spec_from_env, resolve_devices
from flodld.agent.warmpool import WarmPool
from flodld.rank.warm import FORK_SERVER_ENV, WARM_ENV, warm_count

RIDER_POLL_SECS = 0.1
"""How often a host whose own ranks are done looks whether the healed slots riding its relay still need it."""
WALK_IN_CONNECT_ATTEMPTS = 1
"""A healed slot dials once: the controller is the one its host just spoke to; refused, the slot stays
empty."""


class AgentHost:
    """The host's shell and its healed slots' shells, in one event loop."""

    def __init__(
        self, spec: AgentSpec, devices: list[str], warm: WarmPool | None, forks: ForkServer | None
    ) -> None:
        self.spec = spec
        self.forks = forks
        self.own = AgentShell(spec, devices, warm=warm, forks=forks)
        self.own.on_free_slot = self._free_slot
        self.own.before_relay_stop = self._riders_done
        self.heals = SlotHeals(spec.host)
        self.walk_ins: dict[AgentShell, asyncio.Task[int]] = {}

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, self._interrupt, f"signal {signum.name}")
        code = await self.own.run()
        while pending := [task for task in self.walk_ins.values() if not task.done()]:
            if not self._in_the_run():
                self._stop_healing(f"host {self.spec.host!r}'s own run ended")
            # a walk-in that loses its rank may heal its slot in turn
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return code

    def _in_the_run(self) -> bool:
        """Whether this host is still in its run once its own shell finished: it lost every rank and the run
        went on (Finish.left_run), and a healed slot still trains in it.
        """
        formed = (task for shell, task in self.walk_ins.items() if shell.run_id is not None)
        return self.own.left_run and any(not task.done() for task in formed)

    def _stop_healing(self, reason: str) -> None:
        """No slot heals from now on, and the walk-ins still dialing stop (a formed one lives on)."""
        if self.heals.closed is not None:
            return
        self.heals.close(reason)
        late = sv.Interrupted(f"{reason} before this slot's world formed")
        for shell in self.walk_ins:
            if shell.run_id is None:
                shell.post(late)

    def _interrupt(self, reason: str) -> None:
        self.heals.close(f"the agent was interrupted ({reason})")
        for shell in (self.own, *self.walk_ins):
            shell.post(sv.Interrupted(reason))

    def _free_slot(self, device: str) -> None:
        try:
            host = self.heals.freed(asyncio.get_running_loop().time())
        except SlotStaysEmpty as why:
            say(f"slot {device} stays empty: {why}")
            return
        say(f"slot {device} heals in as walk-in host {host!r} (its host-mates keep training)")
        spec = self.spec.model_copy(update={
            "host": host, "devices": [device], "formed_file": None,
            "connect_attempts": WALK_IN_CONNECT_ATTEMPTS,
        })  # fmt: skip
        shell = AgentShell(spec, [device], forks=self.forks)
        shell.on_free_slot = self._free_slot
        shell.for_run = self.own.run_id
        shell.rides = self._ride()
        task = asyncio.ensure_future(shell.run())
        task.add_done_callback(lambda done: say(_ended(host, done)))
        self.walk_ins[shell] = task


    def _ride(self) -> tuple[str, int] | None:
        """The host's own relay, for a healed slot's ranks to ride, while it serves the run (it started, it
        runs, and the host is not being torn down); None: the slot starts a relay of its own.
        """
        own = self.own
        relay, port = own.relay, own.relay_port
        if relay is None or port is None or relay.process.returncode is not None or own.stopping.is_set():
            return None
        return self.spec.host, port

    async def _riders_done(self) -> None:
        """Once no healed slot rides the host's relay any more (those healing meanwhile too): the host's own
        ranks are done and it is about to stop its relay. A slot is done with the relay once its rank has
        exited (it may still be reporting, or waiting for the controller to close its link: up to
        LINGER_SECS over a dead link, which the relay need not outlive) or its shell has ended.
        """
        said = False
        while riders := [task for shell, task in self.walk_ins.items() if _rides_on(shell, task)]:
            if not said:
                said, host = True, self.spec.host
                say(f"host {host!r}'s relay serves {len(riders)} healed slot(s) until they are done")
            await asyncio.wait(riders, timeout=RIDER_POLL_SECS)  # a rank's exit ends no task: look again


def _rides_on(shell: AgentShell, task: asyncio.Task[int]) -> bool:
    """Whether the healed slot of `shell` (its shell's task) still needs the relay it rides."""
    if not shell.rides or task.done():
        return False
    ranks = [child for child in shell.children if child.rank is not None]
    started = len(ranks) == len(shell.devices)
    return not started or any(child.process.returncode is None for child in ranks)


def _ended(host: str, task: asyncio.Task[int]) -> str:
    if task.cancelled():
        return f"walk-in host {host!r} cancelled"
    error = task.exception()
    if error is not None:
        return f"walk-in host {host!r} failed: {error!r}"
    return f"walk-in host {host!r} done (exit code {task.result()})"


def run_agent(spec: AgentSpec | None = None) -> int:
    """Entry of the agent role; returns the process exit code (0 done, 1 transient, 2 permanent).

    Asked for warm ranks (`flodld.rank.warm.WARM_ENV`), it starts them before it reads its spec, so that
    their `import torch` overlaps the wait for the spec, the join and the world's formation.
    """
    try:
        warm = warm_count(os.environ)
    except ValueError as error:
        say(str(error))
        return ExitClass.PERMANENT
    os.environ.pop(WARM_ENV, None)
    return asyncio.run(_run_agent(spec, warm))


async def _run_agent(spec: AgentSpec | None, warm: int) -> int:
    pool = await WarmPool.start(warm, os.environ) if warm else None
    fork_server = os.environ.pop(FORK_SERVER_ENV, None)
    forks = await ForkServer.connect(fork_server, say) if fork_server else None
    try:
        try:
            if spec is None:  # the spec may come on stdin, later: read it off the event loop
                spec = await asyncio.get_running_loop().run_in_executor(None, agent_spec_from_env)
            devices = resolve_devices(spec.devices)
        except (ValueError, DeviceError) as error:
            say(str(error))
            return ExitClass.PERMANENT
        return await AgentHost(spec, devices, pool, forks).run()
    finally:
        if pool is not None:
            await pool.close()
        if forks is not None:
            forks.close()  # the server kills any rank of ours still running
