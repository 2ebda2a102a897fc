"""One run's attempts, decided event by event: the run supervisor behind `fdl run`, `fdl @cluster run`'s
SSH fan-out and `flodld serve` (sans-io).

A *run* is one or more *attempts*; an attempt is one formed world (a controller run with its own run
id, salt, rendezvous namespace and data-plane keys) and the agents that serve it: local subprocesses
(`fdl run`), agents started over SSH on the roster's hosts (the fan-out, `flodld.fanout.cluster_run`),
or none that it starts (`flodld serve`: walk-ins only, so verdicts are its only events). The shells own
the controller, the agent processes, the SSH sessions, the signals and the timers; this module owns
what they mean. States per attempt: RUNNING → CONCLUDING (the controller's verdict is in; the
agents are being collected) → the next attempt, or FINISHED.

Rules:
- an agent that exits before its attempt's world formed (`WorldFormed` not yet fed) stops the attempt
  at once, naming its host: nothing of it can join any more, and the window would wait in vain;
- an agent that exits 0 has finished its host; nothing to do;
- an agent that exits non-zero reports its ranks and closes its link first, so the controller
  concludes from that; the shell waits `AGENT_DIED_GRACE_S` for the verdict, then stops the attempt
  naming the agent (it died unannounced: its ranks are lost);
- a host lost (its SSH session died: keepalives unanswered, or it could not be reached to start its
  agent) stops the attempt at once with the shell's reason; its agent counts as gone. At a restart, before
  the world formed and with other hosts still there, it is left out instead (`Attempt.left_out`, named in
  the attempt's cause should it fail): the window forms without it when the quorum allows;
- every agent gone and no verdict: wait `AGENTS_GONE_GRACE_S`, then stop the attempt;
- an interrupt (SIGINT/SIGTERM to `fdl run`) stops the attempt and the run: never restarted;
- the verdict in, the shell collects the agents (TERM/KILL after `COLLECT_TIMEOUT_S`); then:
  done when the verdict is ok and no agent was killed, else the attempt failed with its *cause*
  (the verdict's reason, or the killed agent). An agent whose end is still unknown `COLLECT_DEADLINE_S`
  after the verdict (a shell that could not learn it) is counted lost and named: the run never waits
  without a word;
- a failed attempt is followed by the next (`restart_count` + 1, a fresh world) while fewer than
  `max_restarts` restarts have been made and nobody interrupted (`next_attempt`, the one rule that
  `flodld serve` applies to its verdicts too); otherwise the run fails with a reason that lists every
  attempt's cause.

- a restart keeps the links of the hosts still there (docs/restarts.md): the controller of a failed attempt
  that a restart follows sends `Reform` instead of `Abort` (`keeps_links`; an interrupt's `StopAttempt`
  asks for Abort), the hosts that answer `Stopped` come with the verdict (`VerdictReached.kept`), are not
  collected, and the next `StartAttempt` names them (`kept`): the shell re-admits them into the new
  window and starts agents only for the others.

As in torchrun, a restart re-forms the whole world: every rank of the next attempt starts anew with
`TORCHELASTIC_RESTART_COUNT` set to the attempt's number, and a script that checkpoints resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from flodld.membership.rootcause import root_cause_lines
from flodld.wire.handlers import HandlerTable

__all__ = [
    "AGENTS_GONE_GRACE_S",
    "AGENT_DIED_GRACE_S",
    "COLLECT_DEADLINE",
    "COLLECT_DEADLINE_S",
    "COLLECT_TIMEOUT_S",
    "Action",
    "AgentExited",
    "ArmTimer",
    "Attempt",
    "CollectAgents",
    "Event",
    "Finish",
    "HostLost",
    "Interrupted",
    "RunSupervisor",
    "Say",
    "StartAttempt",
    "StopAttempt",
    "SupervisorState",
    "TimerExpired",
    "VerdictReached",
    "WorldFormed",
    "describe_code",
    "keeps_links",
    "next_attempt",
    "verdict_event",
]

AGENT_DIED_GRACE_S = 2.0  # an agent that died: the controller's moment to conclude from its link
AGENTS_GONE_GRACE_S = 5.0  # every agent gone and no verdict: the controller's moment to conclude
COLLECT_TIMEOUT_S = 15.0  # after the verdict, how long agents get to exit before they are killed
COLLECT_DEADLINE_S = 90.0  # after the verdict, when an agent whose end is still unknown counts as lost
COLLECT_DEADLINE = "collect-deadline"  # its timer's name

EXIT_DONE = 0
EXIT_FAILED = 1
LOST_CODE = 255  # a lost host's agent: no exit status came back (as ssh reports it)


class SupervisorState(Enum):
    RUNNING = "running"
    CONCLUDING = "concluding"
    FINISHED = "finished"


def next_attempt(restart_count: int, max_restarts: int, *, ok: bool, stopping: bool = False) -> int | None:
    """After an attempt's verdict: the next attempt's restart count (a failure with restarts left, not
    stopping), else None (the job is over: done, stopped, or `max_restarts` used up).

    `flodld serve`'s rule: its runs have no local agents to supervise, only verdicts.
    """
    if ok or stopping or restart_count >= max_restarts:
        return None
    return restart_count + 1


def keeps_links(restart_count: int, max_restarts: int, *, stopping: bool = False) -> bool:
    """Whether this attempt, should it fail, ends with `Reform` rather than `Abort`: a failure is followed by
    the next attempt (`next_attempt`), so its hosts stay linked, stop their ranks and wait to be re-admitted
    into the next attempt's re-formation window (docs/restarts.md). `flodld serve`'s rule.
    """
    return next_attempt(restart_count, max_restarts, ok=False, stopping=stopping) is not None


def describe_code(code: int) -> str:
    """'signal 9' or 'exit code 3' (negative codes are signals, as subprocess reports them)."""
    return f"signal {-code}" if code < 0 else f"exit code {code}"


# Events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentExited:
    """The local agent of `host` exited with `code` (negative: killed by that signal)."""

    host: str
    code: int


@dataclass(frozen=True)
class HostLost:
    """The host's agent is out of reach: its SSH session died, or it could not be started there."""

    host: str
    reason: str


@dataclass(frozen=True)
class WorldFormed:
    """The attempt's world formed (the join window closed with its ranks)."""


@dataclass(frozen=True)
class VerdictReached:
    """The controller concluded the attempt; `report` is printed as it comes in (the root-cause block)."""

    ok: bool
    reason: str
    report: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    """The hosts that answered the failed attempt's `Reform`: their agents stay, linked, for the next one."""


def verdict_event(
    ok: bool, reason: str, root_cause: Mapping[str, Any] | None, kept: tuple[str, ...] = ()
) -> VerdictReached:
    """The event for a controller's verdict: with a root cause (the first observed failure across hosts),
    its summary joins the reason and its block (the failed rank's tail) is the report.
    """
    if root_cause is None:
        return VerdictReached(ok, reason, kept=kept)
    summary = root_cause.get("summary")
    lines = tuple(root_cause_lines(root_cause))
    return VerdictReached(ok, f"{reason}; root cause: {summary}", lines, kept)


@dataclass(frozen=True)
class Interrupted:
    """A signal to the launcher: stop the attempt, and do not restart."""

    reason: str


@dataclass(frozen=True)
class TimerExpired:
    """The timer an `ArmTimer` asked for ran out."""

    name: str


Event = AgentExited | HostLost | WorldFormed | VerdictReached | Interrupted | TimerExpired

# Actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartAttempt:
    """Form a fresh world (new run id, salt, keys) and start its agents; ranks see `restart_count`.

    `kept`: hosts whose agents are still linked from the attempt before (re-admitted into the new window at
    once, not started again); the shell starts agents for the others.
    """

    restart_count: int
    max_restarts: int
    kept: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopAttempt:
    """Ask the controller to end the attempt with `reason` (it aborts the hosts and gives a verdict).

    `keep_links` False: Abort the hosts even if a restart could follow (an interrupt ends the run).
    """

    reason: str
    keep_links: bool = True


@dataclass(frozen=True)
class ArmTimer:
    """Feed `TimerExpired(name)` after `seconds` (arming a name again replaces its timer)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class CollectAgents:
    """Wait up to `timeout_s` for the attempt's agents to exit, KILL the rest; feed each exit."""

    timeout_s: float


@dataclass(frozen=True)
class Say:
    """A line for the operator."""

    message: str


@dataclass(frozen=True)
class Finish:
    exit_code: int
    summary: str


Action = StartAttempt | StopAttempt | ArmTimer | CollectAgents | Say | Finish


@dataclass
class Attempt:
    """One attempt: its number, its hosts, and why it failed (None while it runs, or if it did not)."""

    number: int
    hosts: tuple[str, ...]
    cause: str | None = None
    agent_codes: dict[str, int] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    """Hosts lost before this restart's world formed and left to the window (host -> why)."""


class RunSupervisor:
    """Decides, event by event, what a launcher's shell does with its controller, agents and timers.

    `hosts`: the hosts whose agents the shell starts for each attempt (none for `flodld serve`).
    """

    def __init__(self, hosts: list[str], *, max_restarts: int = 0) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts is {max_restarts}; it counts restarts, 0 or more")
        self.hosts = tuple(hosts)
        self.max_restarts = max_restarts
        self.state = SupervisorState.RUNNING
        self.attempts: list[Attempt] = []
        self._live: set[str] = set()
        self._verdict: VerdictReached | None = None
        self._interrupted = False
        self._stopping = False
        self._formed = False
        self._kept: frozenset[str] = frozenset()
        running: HandlerTable[[], list[Action]] = HandlerTable("event while running")
        running.register(AgentExited, self._agent_exited_running)
        running.register(HostLost, self._host_lost_running)
        running.register(WorldFormed, self._world_formed)
        running.register(VerdictReached, self._verdict_reached)
        running.register(Interrupted, self._interrupted_event)
        running.register(TimerExpired, self._timer_expired)
        concluding: HandlerTable[[], list[Action]] = HandlerTable("event while concluding")
        concluding.register(AgentExited, self._agent_exited_concluding)
        concluding.register(HostLost, self._host_lost_concluding)
        concluding.register(Interrupted, self._interrupted_event)
        concluding.register(TimerExpired, self._collect_deadline)
        self._table = {SupervisorState.RUNNING: running, SupervisorState.CONCLUDING: concluding}

    @property
    def attempt(self) -> Attempt:
        return self.attempts[-1]

    def start(self) -> list[Action]:
        """The first attempt."""
        return self._start_attempt(frozenset())

    def handle(self, event: Event) -> list[Action]:
        """Actions for `event`; an event that means nothing in this state yields none."""
        table = self._table.get(self.state)
        if table is None or type(event) not in table:
            return []
        return table.dispatch(event)

    # --- running ----------------------------------------------------------------------------

    def _start_attempt(self, kept: frozenset[str]) -> list[Action]:
        number = len(self.attempts)
        self.attempts.append(Attempt(number, self.hosts))
        self.state = SupervisorState.RUNNING
        self._live = set(self.hosts)
        self._verdict = None
        self._stopping = False
        self._formed = False
        actions: list[Action] = []
        if number:
            actions.append(
                Say(f"restarting: attempt {number + 1} of at most {self.max_restarts + 1} (restart {number})")
            )
        return [*actions, StartAttempt(number, self.max_restarts, tuple(sorted(kept)))]

    def _gone(self, host: str, code: int) -> bool:
        """Record that `host`'s agent is gone with `code`; False if it was not live (nothing to do)."""
        if host not in self._live:
            return False
        self._live.discard(host)
        self.attempt.agent_codes[host] = code
        return True

    def _agent_exited_running(self, event: AgentExited) -> list[Action]:
        if not self._gone(event.host, event.code):
            return []
        if not self._formed:
            if self._stopping:
                return []
            code = describe_code(event.code)
            return self._stop(f"the agent of host {event.host!r} exited ({code}) before the world formed")
        actions: list[Action] = []
        if event.code != 0:
            actions.append(ArmTimer(f"agent-died:{event.host}", AGENT_DIED_GRACE_S))
        if not self._live:
            actions.append(ArmTimer("agents-gone", AGENTS_GONE_GRACE_S))
        return actions

    def _world_formed(self, event: WorldFormed) -> list[Action]:
        self._formed = True
        return []

    def _host_lost_running(self, event: HostLost) -> list[Action]:
        if not self._gone(event.host, LOST_CODE) or self._stopping:
            return []
        if self.attempt.number and not self._formed and self._live:
            # At a restart, a host that cannot be reached is left out: the window forms without it when the
            # quorum allows (its join_timeout), and fails below quorum at its hard cap.
            self.attempt.left_out[event.host] = event.reason
            return [Say(
                f"{event.reason}; host {event.host!r} left out of attempt {self.attempt.number + 1} "
                "(the world forms without it if the quorum allows)"
            )]  # fmt: skip
        return [Say(f"{event.reason}; stopping the attempt"), *self._stop(event.reason)]

    def _timer_expired(self, event: TimerExpired) -> list[Action]:
        if self._stopping:
            return []
        if event.name.startswith("agent-died:"):
            host = event.name.partition(":")[2]
            code = self.attempt.agent_codes.get(host, 1)
            return self._stop(
                f"the agent of host {host!r} died ({describe_code(code)}) without reporting its ranks"
            )
        if event.name == "agents-gone":
            return self._stop("every agent exited but the run did not conclude")
        return []

    def _interrupted_event(self, event: Interrupted) -> list[Action]:
        self._interrupted = True
        if self.state is SupervisorState.CONCLUDING or self._stopping:
            return []
        return [
            Say(f"{event.reason}; aborting the run"),
            *self._stop(f"{event.reason} (fdl run)", keep_links=False),
        ]

    def _stop(self, reason: str, *, keep_links: bool = True) -> list[Action]:
        self._stopping = True
        return [StopAttempt(reason, keep_links)]

    def _verdict_reached(self, event: VerdictReached) -> list[Action]:
        self._verdict = event
        self.state = SupervisorState.CONCLUDING
        report: list[Action] = [Say(line) for line in event.report]
        # Hosts kept linked (they answered Reform) are not collected: their agents serve the next attempt.
        self._kept = frozenset() if self._interrupted else frozenset(event.kept) & self._live
        self._live -= self._kept
        if self._live:
            return [*report, CollectAgents(COLLECT_TIMEOUT_S), ArmTimer(COLLECT_DEADLINE, COLLECT_DEADLINE_S)]
        return [*report, *self._conclude()]

    # --- concluding -------------------------------------------------------------------------

    def _agent_exited_concluding(self, event: AgentExited) -> list[Action]:
        if not self._gone(event.host, event.code):
            return []
        return [] if self._live else self._conclude()

    def _host_lost_concluding(self, event: HostLost) -> list[Action]:
        return self._agent_exited_concluding(AgentExited(event.host, LOST_CODE))

    def _collect_deadline(self, event: TimerExpired) -> list[Action]:
        if event.name != COLLECT_DEADLINE or not self._live:
            return []
        unknown = sorted(self._live)
        for host in unknown:
            self._gone(host, LOST_CODE)
        named = ", ".join(repr(host) for host in unknown)
        note = Say(
            f"the end of the agent(s) of host(s) {named} is still unknown {COLLECT_DEADLINE_S:g}s after the "
            "verdict; counted as lost"
        )
        return [note, *self._conclude()]

    def _cause(self) -> str | None:
        verdict = self._verdict
        assert verdict is not None
        if not verdict.ok:
            left_out = self.attempt.left_out
            if left_out:
                named = "; ".join(f"host {host!r}: {why}" for host, why in sorted(left_out.items()))
                return f"{verdict.reason} (left out: {named})"
            return verdict.reason
        killed = [(host, code) for host, code in self.attempt.agent_codes.items() if code < 0]
        if killed:
            # A killed agent closes its link like a finished one; its unreported ranks make the run lost.
            host, code = killed[0]
            return (
                f"the agent of host {host!r} died ({describe_code(code)}); the controller saw its host link "
                f"close ({verdict.reason})"
            )
        return None

    def _conclude(self) -> list[Action]:
        cause = self._cause()
        attempt = self.attempt
        if cause is None:
            self.state = SupervisorState.FINISHED
            assert self._verdict is not None
            return [Finish(EXIT_DONE, f"run done: {self._verdict.reason}{self._attempts_note()}")]
        attempt.cause = cause
        if next_attempt(attempt.number, self.max_restarts, ok=False, stopping=self._interrupted) is not None:
            return [Say(f"attempt {attempt.number + 1} failed: {cause}"), *self._start_attempt(self._kept)]
        self.state = SupervisorState.FINISHED
        return [Finish(EXIT_FAILED, self._failure_summary())]

    def _attempts_note(self) -> str:
        failed = [a for a in self.attempts if a.cause is not None]
        if not failed:
            return ""
        return f" (after {len(failed)} restart(s): " + "; ".join(
            f"attempt {a.number + 1}: {a.cause}" for a in failed
        ) + ")"

    def _failure_summary(self) -> str:
        if len(self.attempts) == 1:
            return f"run FAILED: {self.attempt.cause}"
        why = "interrupted" if self._interrupted else f"max_restarts ({self.max_restarts}) exhausted"
        causes = "; ".join(f"attempt {a.number + 1}: {a.cause}" for a in self.attempts)
        return f"run FAILED after {len(self.attempts)} attempts ({why}): {causes}"
