"""The run's lifecycle as an explicit transition table, and the pure window verdict.

Rules:
- A phase changes only through `advance(phase, event)`, i.e. through a row of `TRANSITIONS`. The table has
  no edge back to an earlier phase, so the lifecycle cannot go backwards; `done` and `failed` are terminal.
- While the window is open (waiting / staging), `verdict()` turns the clock, the joined rank count and the
  start switch into events. Every event that leads to `forming` is emitted only with quorum met, so the
  world can never form below quorum.
- After formation the shell drives the table with explicit events: artifacts shipped, all host links
  closed, rank failures beyond tolerance, abort.

The mermaid diagram in docs/join-window.md is `render_mermaid()`'s output.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from flodld.membership.policy import StartMode, WindowPolicy


class Phase(StrEnum):
    """What `fdl status` prints as the lifecycle phase."""

    WAITING = "waiting"
    STAGING = "staging"
    FORMING = "forming"
    TRAINING = "training"
    DONE = "done"
    FAILED = "failed"


class Event(StrEnum):
    """Something that moves the lifecycle forward."""

    QUORUM_MET = "quorum_met"  # manual/hybrid: the roster became startable
    TARGET_REACHED = "target_reached"  # auto/hybrid early close
    WINDOW_EXPIRED = "window_expired"  # auto/hybrid: the clock closed the window with quorum met
    START_FIRED = "start_fired"  # manual/hybrid: the operator's armed start, quorum met
    HARD_CAP = "hard_cap"  # cap passed: quorum never met, or a manual start never fired
    ARTIFACTS_SHIPPED = "artifacts_shipped"  # WorldFormed sent to every host
    LINKS_CLOSED = "links_closed"  # every host's join link has closed
    RANKS_FAILED = "ranks_failed"  # more ranks failed than the tolerance allows
    ABORTED = "aborted"  # the controller gave up (shutdown, coordinator lost, ...)


WINDOW_PHASES = frozenset({Phase.WAITING, Phase.STAGING})
TERMINAL_PHASES = frozenset({Phase.DONE, Phase.FAILED})

TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.WAITING, Event.QUORUM_MET): Phase.STAGING,
    (Phase.WAITING, Event.TARGET_REACHED): Phase.FORMING,
    (Phase.WAITING, Event.WINDOW_EXPIRED): Phase.FORMING,
    (Phase.WAITING, Event.HARD_CAP): Phase.FAILED,
    (Phase.WAITING, Event.ABORTED): Phase.FAILED,
    (Phase.STAGING, Event.START_FIRED): Phase.FORMING,
    (Phase.STAGING, Event.TARGET_REACHED): Phase.FORMING,
    (Phase.STAGING, Event.WINDOW_EXPIRED): Phase.FORMING,
    (Phase.STAGING, Event.HARD_CAP): Phase.FAILED,
    (Phase.STAGING, Event.ABORTED): Phase.FAILED,
    (Phase.FORMING, Event.ARTIFACTS_SHIPPED): Phase.TRAINING,
    # Not drawn in the seed diagram: an abort while artifacts are being shipped.
    (Phase.FORMING, Event.ABORTED): Phase.FAILED,
    (Phase.TRAINING, Event.LINKS_CLOSED): Phase.DONE,
    (Phase.TRAINING, Event.RANKS_FAILED): Phase.FAILED,
    (Phase.TRAINING, Event.ABORTED): Phase.FAILED,
}

# Edge labels for the diagram, in the seed's words.
TRANSITION_LABELS: dict[tuple[Phase, Event], str] = {
    (Phase.WAITING, Event.QUORUM_MET): "manual/hybrid — quorum met",
    (Phase.WAITING, Event.TARGET_REACHED): "auto/hybrid — target reached",
    (Phase.WAITING, Event.WINDOW_EXPIRED): "auto/hybrid — expiry, quorum met",
    (Phase.WAITING, Event.HARD_CAP): "hard cap, quorum never met",
    (Phase.WAITING, Event.ABORTED): "aborted",
    (Phase.STAGING, Event.START_FIRED): "fdl start",
    (Phase.STAGING, Event.TARGET_REACHED): "hybrid — target reached",
    (Phase.STAGING, Event.WINDOW_EXPIRED): "hybrid — expiry, quorum met",
    (Phase.STAGING, Event.HARD_CAP): "hard cap, start never fired (manual) or quorum lost",
    (Phase.STAGING, Event.ABORTED): "aborted",
    (Phase.FORMING, Event.ARTIFACTS_SHIPPED): "artifacts shipped",
    (Phase.FORMING, Event.ABORTED): "aborted",
    (Phase.TRAINING, Event.LINKS_CLOSED): "every host link closed",
    (Phase.TRAINING, Event.RANKS_FAILED): "cohort below tolerance",
    (Phase.TRAINING, Event.ABORTED): "coordinator lost / aborted",
}


class TransitionError(ValueError):
    """An event arrived in a phase that has no row for it in `TRANSITIONS`."""


def advance(phase: Phase, event: Event) -> Phase:
    """The next phase, straight from the table; anything not in it is refused."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        allowed = sorted(e.value for (p, e) in TRANSITIONS if p is phase)
        hint = f"allowed here: {', '.join(allowed)}" if allowed else f"{phase.value} is terminal"
        raise TransitionError(
            f"event {event.value!r} cannot happen in phase {phase.value!r} ({hint})"
        ) from None


@dataclass(frozen=True)
class Verdict:
    """Where the window stands now, why, and the events that got it there from the given phase."""

    phase: Phase
    reason: str
    events: tuple[Event, ...] = ()


def verdict(
    policy: WindowPolicy, phase: Phase, *, elapsed: float, joined_ranks: int, start_armed: bool
) -> Verdict:
    """Decide the window from the clock, the joined ranks and the start switch (pure; first rule wins)."""
    if phase not in WINDOW_PHASES:
        return Verdict(phase, f"window closed ({phase.value})")
    quorum_met = joined_ranks >= policy.quorum
    manual = policy.start is StartMode.MANUAL
    # manual/hybrid pass through staging once quorum is met; the clock's closes skip it.
    becomes_startable = policy.start is not StartMode.AUTO and quorum_met and phase is Phase.WAITING
    decided = _closing_event(policy, elapsed, joined_ranks, start_armed, quorum_met, manual)
    if decided is None:
        events = [Event.QUORUM_MET] if becomes_startable else []
        return _settle(phase, events, _holding_reason(policy, joined_ranks, quorum_met, elapsed))
    event, reason = decided
    if becomes_startable and event in (Event.START_FIRED, Event.HARD_CAP):
        return _settle(phase, [Event.QUORUM_MET, event], reason)
    return _settle(phase, [event], reason)


def _closing_event(
    policy: WindowPolicy,
    elapsed: float,
    joined: int,
    start_armed: bool,
    quorum_met: bool,
    manual: bool,
) -> tuple[Event, str] | None:
    if start_armed and policy.start is not StartMode.AUTO and quorum_met:
        return Event.START_FIRED, f"operator start ({joined} of quorum {policy.quorum} ranks in)"
    if policy.target is not None and not manual and joined >= policy.target:
        return Event.TARGET_REACHED, f"target ranks reached ({joined} of target {policy.target})"
    if elapsed < policy.window_secs:
        return None
    if not manual and quorum_met:
        return (
            Event.WINDOW_EXPIRED,
            f"join window closed with quorum ({joined} of quorum {policy.quorum} ranks)",
        )
    if elapsed < policy.cap_secs:
        return None
    cap = f"{policy.cap_secs:g}s"
    if manual and quorum_met:
        return Event.HARD_CAP, (
            f"operator start not received: {joined} ranks staged with quorum {policy.quorum} met, but start: "
            f"manual got no fdl start within the {cap} hard cap — raise max_join_timeout for a longer hold"
        )
    return Event.HARD_CAP, f"quorum not met: {joined} of {policy.quorum} ranks joined after {cap} hard cap"


def _holding_reason(policy: WindowPolicy, joined: int, quorum_met: bool, elapsed: float) -> str:
    if not quorum_met:
        clock = "window" if elapsed < policy.window_secs else "grace until hard cap"
        return f"waiting for quorum: {joined} of {policy.quorum} ranks joined ({clock})"
    if policy.start is StartMode.MANUAL:
        return f"staging: {joined} ranks in, quorum {policy.quorum} met — startable, fire with fdl start"
    if policy.start is StartMode.HYBRID:
        return (
            f"staging: {joined} ranks in, quorum {policy.quorum} met — startable, fire with fdl start "
            "or wait for the target / window expiry"
        )
    target = f"target {policy.target}" if policy.target is not None else "no target"
    return f"quorum met ({joined} of {policy.quorum}); window open for late joiners ({target})"


def _settle(phase: Phase, events: list[Event], reason: str) -> Verdict:
    for event in events:
        phase = advance(phase, event)
    return Verdict(phase, reason, tuple(events))


def render_mermaid() -> str:
    """The state diagram of `TRANSITIONS` as a mermaid stateDiagram, one line per table row."""
    lines = ["stateDiagram-v2", "    [*] --> waiting: window opens"]
    for (source, event), target in TRANSITIONS.items():
        label = TRANSITION_LABELS[(source, event)]
        lines.append(f"    {source.value} --> {target.value}: {label} [{event.value}]")
    lines += ["    done --> [*]", "    failed --> [*]"]
    return "\n".join(lines) + "\n"
