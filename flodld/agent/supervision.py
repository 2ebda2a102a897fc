"""What the agent does when its children or its controller link change: a pure decision table.

States: RUNNING → TEARING_DOWN → DONE. Every event returns the actions the shell performs
(report, signal, close), so the shell owns processes and timers and this module owns meaning.

Rules:
- every rank exit is reported up the join link (RankExited), whatever else happens, marked `torn_down`
  when the rank ended after this host's teardown began (its exit is then a consequence of our own
  TERM/KILL, never the run's root cause: flodld/membership/rootcause.py);
- a rank exiting non-zero tears the host down: its peers would otherwise hang in a collective
  waiting for it (the controller hears the exit and decides for the other hosts) — unless the run
  averages through the relay and tolerates losses (`tolerance` > 0, docs/elastic-averaging.md): the
  relay folds the rank out of its rounds, its host-mates keep training, and the controller, which counts
  failures across hosts, sends Abort once they exceed the tolerance;
- in a run that also grows (`grows`: walk-ins enter during training), a rank that failed or was declared dead
  while the host runs frees its slot (ReportRankExit.frees_slot): the agent offers that device as a walk-in
  of its own (flodld/agent/host.py), so the slot heals while its host-mates keep training;
- a rank the controller declared dead (KillRank: silent past the heartbeat timeout) is asked for its
  Python stack (DumpStack: the stack signal, then CONT so a stopped rank runs its handler) and killed
  `stack_grace` seconds later (KillOne); its exit is then reported as any other;
- when every rank has exited cleanly, the relay's job is over and it is asked to stop;
- the relay failing (non-zero exit) while ranks run, Abort from the controller, losing the controller link,
  or a signal to the agent tear the host down: TERM to every child, KILL after the grace period;
- when no child is left, the join link is closed (the controller's "host done" event) and the
  agent exits 0 only if nothing tore the host down (in a run that survives losses, ranks may have failed:
  the controller's verdict says whether the run survived them);
- a host that tore itself down (its own rank or relay failed) in an attempt a restart may follow first
  waits a moment for the controller's word (AwaitWord): the failure it reported makes the controller send
  Reform (this host stays linked for the next attempt, docs/restarts.md) or Abort; closing the link at once
  would race that word and cost the host its link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from flodld.wire.handlers import HandlerTable


class SupervisorState(Enum):
    RUNNING = "running"
    TEARING_DOWN = "tearing_down"
    DONE = "done"


# Events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExitDetail:
    """What the shell learned about a rank's exit beyond its code (carried to the controller as is)."""

    failed_at: float | None = None  # unix seconds when the rank failed (its exception, else its exit)
    error: str | None = None  # the exception from the rank's error file
    tail: str | None = None  # its last output lines, scrubbed


@dataclass(frozen=True)
class RankExit:
    """A rank's process exited with `code` (negative: killed by that signal); `at`: when it failed, on the
    shell's monotonic clock (the one `handle(now=...)` gets; its exception if it raised, else its exit; None:
    unknown). A rank that raised before the teardown began is no victim of it, even if our TERM caught it
    while its interpreter was still shutting down.
    """

    rank: int
    code: int
    at: float | None = None
    detail: ExitDetail = field(default_factory=ExitDetail)


@dataclass(frozen=True)
class RelayExit:
    code: int


@dataclass(frozen=True)
class _TeardownCause:
    reason: str


class AbortReceived(_TeardownCause):
    """The controller sent Abort."""


class LinkLost(_TeardownCause):
    """The join link to the controller is gone."""


class Interrupted(_TeardownCause):
    """A signal to the agent."""


@dataclass(frozen=True)
class GraceExpired:
    pass


@dataclass(frozen=True)
class RankDeclaredDead:
    """The controller declared `rank` dead (KillRank) in a run that survives its loss."""

    rank: int
    reason: str


@dataclass(frozen=True)
class StackGraceExpired:
    """The time a declared-dead rank had to dump its stack is over."""

    rank: int


Event = (
    RankExit
    | RelayExit
    | AbortReceived
    | LinkLost
    | Interrupted
    | GraceExpired
    | RankDeclaredDead
    | StackGraceExpired
)

# Actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportRankExit:
    """Report the rank's exit up the join link; `torn_down`: it followed this host's teardown. `frees_slot`:
    it failed on its own while this host runs, in a run that grows, so its device may walk in again.
    """

    rank: int
    code: int
    torn_down: bool = False
    detail: ExitDetail = field(default_factory=ExitDetail)
    frees_slot: bool = False


@dataclass(frozen=True)
class TerminateRelay:
    """Stop the relay gracefully: the ranks are done with it."""


@dataclass(frozen=True)
class TerminateAll:
    """TERM every live child's process group and arm the grace timer."""

    reason: str


@dataclass(frozen=True)
class KillAll:
    """KILL every live child's process group: the grace period is over."""


@dataclass(frozen=True)
class DumpStack:
    """Send the rank the stack-dump signal, then CONT (a stopped rank runs its handler), and arm the stack
    grace timer (StackGraceExpired).
    """

    rank: int
    reason: str


@dataclass(frozen=True)
class KillOne:
    """KILL one rank's process group (a declared-dead rank whose stack grace is over)."""

    rank: int


@dataclass(frozen=True)
class AwaitWord:
    """Before closing the link, wait (bounded) for the controller's Reform or Abort: this host's own
    failure will end the attempt, and a restart may follow.
    """


@dataclass(frozen=True)
class CloseLink:
    """Close the join link; the controller reads it as this host being done."""


@dataclass(frozen=True)
class Finish:
    """Exit with `exit_code`. `left_run`: this host lost every rank within the run's tolerance, so the run
    may go on without it (`fdl join --persist` then dials again at once, see clients/fdl/join.py).
    """

    exit_code: int
    summary: str
    left_run: bool = False


Action = (
    ReportRankExit
    | TerminateRelay
    | TerminateAll
    | KillAll
    | DumpStack
    | KillOne
    | AwaitWord
    | CloseLink
    | Finish
)


def describe_exit(code: int) -> str:
    """'code 3' or 'signal 9' (negative codes are signals, as subprocess reports them)."""
    return f"signal {-code}" if code < 0 else f"code {code}"


class Supervisor:
    """Decides, event by event, what the agent's shell must do with its children and link."""

    def __init__(
        self,
        host: str,
        ranks: list[int],
        *,
        has_relay: bool,
        own_relay: bool = True,
        tolerance: int = 0,
        may_restart: bool = False,
        grows: bool = False,
    ) -> None:
        self.host = host
        self.may_restart = may_restart  # restarts remain after this attempt (the controller may Reform)
        self.own_teardown = False  # the teardown began here (a rank or the relay failed), not by a word
        # The relay folds a lost rank out of the rounds and the run survives `tolerance` losses: a failed
        # rank's host-mates keep running (a process group could not lose a member: torn down as before).
        self.keeps_survivors = has_relay and tolerance > 0
        self.frees_slots = self.keeps_survivors and grows  # a lost rank's device may walk in again
        self.declared_dead: dict[int, str] = {}  # ranks asked for their stack, by the controller's reason
        self.state = SupervisorState.RUNNING
        self.ranks = frozenset(ranks)
        self.live_ranks = set(ranks)
        # A healed slot that rides its host's relay averages through a relay that is not its child.
        self.relay_live = has_relay and own_relay
        self.failed_ranks: dict[int, int] = {}
        self.teardown_reason: str | None = None
        self.teardown_at: float | None = None  # when the teardown began (the `now` of its event)
        self._now = -math.inf
        self._relay_stop_requested = False
        # Per state, the events that mean something there; any other event in that state changes nothing.
        running: HandlerTable[[], list[Action]] = HandlerTable("event while running")
        running.register(RankExit, self._rank_exit)
        running.register(RelayExit, self._relay_exit)
        running.register(AbortReceived, self._teardown_event)
        running.register(LinkLost, self._teardown_event)
        running.register(Interrupted, self._teardown_event)
        running.register(RankDeclaredDead, self._declared_dead)
        running.register(StackGraceExpired, self._stack_grace_expired)
        tearing_down: HandlerTable[[], list[Action]] = HandlerTable("event while tearing down")
        tearing_down.register(RankExit, self._rank_exit)
        tearing_down.register(RelayExit, self._relay_exit)
        tearing_down.register(GraceExpired, lambda event: [KillAll()])
        self._table = {SupervisorState.RUNNING: running, SupervisorState.TEARING_DOWN: tearing_down}

    def handle(self, event: Event, now: float | None = None) -> list[Action]:
        """Actions for `event` handled at `now` (the shell's monotonic clock; None: unknown, every rank exit
        during a teardown then counts as torn down); events that change nothing in this state yield none.
        """
        self._now = -math.inf if now is None else now
        table = self._table.get(self.state)
        if table is None or type(event) not in table:
            return []
        return table.dispatch(event)

    def start(self) -> list[Action]:
        """Actions due before any event (a host with no children finishes at once)."""
        return self._finish_if_empty()

    @property
    def children_live(self) -> int:
        return len(self.live_ranks) + int(self.relay_live)

    def _rank_exit(self, event: RankExit) -> list[Action]:
        if event.rank not in self.live_ranks:
            return []
        self.live_ranks.discard(event.rank)
        # Torn down: the exit came after our teardown began. A rank that failed on its own just before (its
        # `at` is earlier, even if the event reached us later) is a failure in its own right.
        torn_down = self.teardown_at is not None and (event.at is None or event.at >= self.teardown_at)
        running = self.state is SupervisorState.RUNNING
        frees = event.code != 0 and running and self.frees_slots and not torn_down
        actions: list[Action] = [ReportRankExit(event.rank, event.code, torn_down, event.detail, frees)]
        if event.code != 0:
            self.failed_ranks[event.rank] = event.code
            if running and not self.keeps_survivors:
                reason = f"rank {event.rank} exited with {describe_exit(event.code)}"
                actions += self._begin_teardown(reason, own=True)
        relay_idle = not self.live_ranks and self.relay_live and not self._relay_stop_requested
        if relay_idle and self.state is SupervisorState.RUNNING:
            self._relay_stop_requested = True
            actions.append(TerminateRelay())
        return actions + self._finish_if_empty()

    def _relay_exit(self, event: RelayExit) -> list[Action]:
        if not self.relay_live:
            return []
        self.relay_live = False
        actions: list[Action] = []
        # Exit 0 is the relay's clean stop (every rank closed its legs), which can be seen before
        # the ranks' own exits; only a failing relay leaves live ranks without their data plane.
        failed = event.code != 0 and not self._relay_stop_requested
        if self.state is SupervisorState.RUNNING and self.live_ranks and failed:
            actions += self._begin_teardown(
                f"relay died ({describe_exit(event.code)}) while ranks were running", own=True
            )
        return actions + self._finish_if_empty()

    def _declared_dead(self, event: RankDeclaredDead) -> list[Action]:
        if event.rank not in self.live_ranks or event.rank in self.declared_dead:
            return []
        self.declared_dead[event.rank] = event.reason
        return [DumpStack(event.rank, event.reason)]

    def _stack_grace_expired(self, event: StackGraceExpired) -> list[Action]:
        return [KillOne(event.rank)] if event.rank in self.live_ranks else []

    def _teardown_event(self, event: _TeardownCause) -> list[Action]:
        prefix = {
            AbortReceived: "abort from the controller",
            LinkLost: "controller link lost",
            Interrupted: "interrupted",
        }
        return self._begin_teardown(f"{prefix[type(event)]}: {event.reason}") + self._finish_if_empty()

    def _begin_teardown(self, reason: str, *, own: bool = False) -> list[Action]:
        self.state = SupervisorState.TEARING_DOWN
        self.teardown_reason = reason
        self.teardown_at = self._now
        self.own_teardown = own
        return [TerminateAll(reason)] if self.children_live else []

    def _finish_if_empty(self) -> list[Action]:
        if self.children_live or self.state is SupervisorState.DONE:
            return []
        self.state = SupervisorState.DONE
        if self.teardown_reason is not None:
            word: list[Action] = [AwaitWord()] if self.own_teardown and self.may_restart else []
            return [*word, CloseLink(), Finish(1, f"host {self.host!r} torn down: {self.teardown_reason}")]
        if self.failed_ranks:
            # Within a run that survives losses, as it was asked to: the controller counts the failures and
            # says whether the run survived them (a launcher reads a non-zero agent as a host that died).
            lost = ", ".join(f"rank {r} ({describe_exit(c)})" for r, c in sorted(self.failed_ranks.items()))
            if self.failed_ranks.keys() >= self.ranks:
                summary = f"host {self.host!r} lost every rank: {lost}; the run may go on without it"
                return [CloseLink(), Finish(0, summary, left_run=True)]
            summary = f"host {self.host!r} finished without {lost}; its other ranks ran on"
            return [CloseLink(), Finish(0, summary)]
        return [CloseLink(), Finish(0, f"host {self.host!r} finished cleanly")]
