from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodld.membership.phase import (
    TERMINAL_PHASES,
    TRANSITIONS,
    Event,
    Phase,
    TransitionError,
    advance,
    render_mermaid,
    verdict,
)
from flodld.membership.policy import WindowPolicy
from tests.flodld.membership.helpers import policy

# Lifecycle order: a transition must always move to a strictly later rank.
ORDER = {
    Phase.WAITING: 0,
    Phase.STAGING: 1,
    Phase.FORMING: 2,
    Phase.TRAINING: 3,
    Phase.DONE: 4,
    Phase.FAILED: 4,
}


@pytest.mark.parametrize(("source", "event", "target"), [(s, e, t) for (s, e), t in TRANSITIONS.items()])
def test_every_table_row_is_a_forward_transition(source: Phase, event: Event, target: Phase) -> None:
    assert advance(source, event) is target
    assert ORDER[target] > ORDER[source]


@pytest.mark.parametrize(
    ("source", "event"), [(p, e) for p in Phase for e in Event if (p, e) not in TRANSITIONS]
)
def test_events_without_a_row_are_refused(source: Phase, event: Event) -> None:
    with pytest.raises(TransitionError, match=event.value):
        advance(source, event)


def test_done_and_failed_are_terminal() -> None:
    assert not [key for key in TRANSITIONS if key[0] in TERMINAL_PHASES]


def test_the_seed_diagram_edges_are_all_in_the_table() -> None:
    edges = {(s, t) for (s, _), t in TRANSITIONS.items()}
    seed = {
        (Phase.WAITING, Phase.FORMING),
        (Phase.WAITING, Phase.STAGING),
        (Phase.STAGING, Phase.FORMING),
        (Phase.WAITING, Phase.FAILED),
        (Phase.STAGING, Phase.FAILED),
        (Phase.FORMING, Phase.TRAINING),
        (Phase.TRAINING, Phase.DONE),
        (Phase.TRAINING, Phase.FAILED),
    }
    assert edges - seed == {(Phase.FORMING, Phase.FAILED)}  # abort while shipping, documented
    assert seed <= edges


def test_mermaid_lists_every_transition() -> None:
    diagram = render_mermaid()
    for (source, event), target in TRANSITIONS.items():
        assert f"{source.value} --> {target.value}: " in diagram
        assert f"[{event.value}]" in diagram


W, C = 300.0, 600.0

# (name, knobs, phase, elapsed, joined, armed, expected phase, events, reason fragment)
VERDICTS: list[tuple[str, dict[str, Any], Phase, float, int, bool, Phase, tuple[Event, ...], str]] = [
    (
        "auto_target_closes_early",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        50,
        4,
        False,
        Phase.FORMING,
        (Event.TARGET_REACHED,),
        "target ranks reached",
    ),
    (
        "auto_quorum_early_keeps_window_open",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        10,
        2,
        False,
        Phase.WAITING,
        (),
        "quorum met",
    ),
    (
        "auto_forms_exactly_at_window_expiry",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        W,
        2,
        False,
        Phase.FORMING,
        (Event.WINDOW_EXPIRED,),
        "join window closed with quorum",
    ),
    (
        "auto_grace_range_waits_below_quorum",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        420,
        1,
        False,
        Phase.WAITING,
        (),
        "waiting for quorum: 1 of 2",
    ),
    (
        "auto_grace_range_forms_on_quorum",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        420,
        2,
        False,
        Phase.FORMING,
        (Event.WINDOW_EXPIRED,),
        "join window closed with quorum",
    ),
    (
        "auto_cap_below_quorum_fails_loudly",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        C,
        1,
        False,
        Phase.FAILED,
        (Event.HARD_CAP,),
        "quorum not met: 1 of 2 ranks joined after 600s hard cap",
    ),
    (
        "auto_ignores_the_start_switch",
        {"min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        10,
        3,
        True,
        Phase.WAITING,
        (),
        "quorum met",
    ),
    (
        "manual_quorum_enters_staging",
        {"start": "manual", "min_rank_start": 2},
        Phase.WAITING,
        20,
        2,
        False,
        Phase.STAGING,
        (Event.QUORUM_MET,),
        "startable",
    ),
    (
        "manual_holds_through_window_expiry",
        {"start": "manual", "min_rank_start": 2},
        Phase.STAGING,
        450,
        5,
        False,
        Phase.STAGING,
        (),
        "startable",
    ),
    (
        "manual_start_forms",
        {"start": "manual", "min_rank_start": 2},
        Phase.STAGING,
        450,
        2,
        True,
        Phase.FORMING,
        (Event.START_FIRED,),
        "operator start",
    ),
    (
        "manual_start_from_waiting_passes_staging",
        {"start": "manual", "min_rank_start": 2},
        Phase.WAITING,
        5,
        2,
        True,
        Phase.FORMING,
        (Event.QUORUM_MET, Event.START_FIRED),
        "operator start",
    ),
    (
        "manual_start_below_quorum_waits",
        {"start": "manual", "min_rank_start": 2},
        Phase.WAITING,
        5,
        1,
        True,
        Phase.WAITING,
        (),
        "waiting for quorum",
    ),
    (
        "manual_never_started_fails_at_cap",
        {"start": "manual", "min_rank_start": 2},
        Phase.STAGING,
        C,
        2,
        False,
        Phase.FAILED,
        (Event.HARD_CAP,),
        "operator start not received: 2 ranks staged",
    ),
    (
        "manual_jump_to_cap_passes_staging",
        {"start": "manual", "min_rank_start": 2},
        Phase.WAITING,
        C,
        2,
        False,
        Phase.FAILED,
        (Event.QUORUM_MET, Event.HARD_CAP),
        "operator start not received",
    ),
    (
        "manual_cap_below_quorum",
        {"start": "manual", "min_rank_start": 2},
        Phase.WAITING,
        C,
        1,
        False,
        Phase.FAILED,
        (Event.HARD_CAP,),
        "quorum not met: 1 of 2",
    ),
    (
        "hybrid_quorum_enters_staging",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        10,
        2,
        False,
        Phase.STAGING,
        (Event.QUORUM_MET,),
        "or wait for the target",
    ),
    (
        "hybrid_operator_fires_early",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.STAGING,
        10,
        2,
        True,
        Phase.FORMING,
        (Event.START_FIRED,),
        "operator start",
    ),
    (
        "hybrid_clock_closes_staging",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.STAGING,
        W,
        3,
        False,
        Phase.FORMING,
        (Event.WINDOW_EXPIRED,),
        "join window closed",
    ),
    (
        "hybrid_target_closes_staging",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.STAGING,
        20,
        4,
        False,
        Phase.FORMING,
        (Event.TARGET_REACHED,),
        "target ranks reached",
    ),
    (
        "hybrid_target_closes_waiting_directly",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.WAITING,
        20,
        4,
        False,
        Phase.FORMING,
        (Event.TARGET_REACHED,),
        "target ranks reached",
    ),
    (
        "staging_below_quorum_never_forms",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.STAGING,
        400,
        1,
        True,
        Phase.STAGING,
        (),
        "waiting for quorum",
    ),
    (
        "staging_below_quorum_fails_at_cap",
        {"start": "hybrid", "min_rank_start": 2, "target_ranks": 4},
        Phase.STAGING,
        C,
        1,
        True,
        Phase.FAILED,
        (Event.HARD_CAP,),
        "quorum not met: 1 of 2",
    ),
    (
        "discovery_runs_the_full_window",
        {"discovery": True, "min_rank_start": 1},
        Phase.WAITING,
        299,
        8,
        False,
        Phase.WAITING,
        (),
        "no target",
    ),
    (
        "window_closed_phases_are_left_alone",
        {},
        Phase.TRAINING,
        C * 10,
        0,
        True,
        Phase.TRAINING,
        (),
        "window closed",
    ),
]


@pytest.mark.parametrize(
    ("knobs", "phase", "elapsed", "joined", "armed", "expected", "events", "reason"),
    [row[1:] for row in VERDICTS],
    ids=[row[0] for row in VERDICTS],
)
def test_verdict(
    knobs: dict[str, Any],
    phase: Phase,
    elapsed: float,
    joined: int,
    armed: bool,
    expected: Phase,
    events: tuple[Event, ...],
    reason: str,
) -> None:
    result = verdict(
        policy(capacity=4, **knobs), phase, elapsed=elapsed, joined_ranks=joined, start_armed=armed
    )
    assert (result.phase, result.events) == (expected, events)
    assert reason in result.reason


@st.composite
def policies(draw: st.DrawFn) -> WindowPolicy:
    start = draw(st.sampled_from(["auto", "manual", "hybrid"]))
    quorum = draw(st.integers(1, 6))
    target = None if start == "manual" else draw(st.none() | st.integers(quorum, 8))
    window = draw(st.floats(1, 500))
    cap = window + draw(st.floats(0, 500))
    discovery = draw(st.booleans())
    knobs: dict[str, Any] = {
        "start": start,
        "min_rank_start": quorum,
        "join_timeout": window,
        "max_join_timeout": cap,
        "discovery": discovery,
    }
    if target is not None:
        knobs["target_ranks"] = target
    return policy(capacity=8, **knobs)


@st.composite
def monotone_inputs(draw: st.DrawFn) -> list[tuple[float, int, bool]]:
    steps = draw(st.lists(st.tuples(st.floats(0, 300), st.integers(0, 3), st.booleans()), max_size=25))
    elapsed, joined, armed = 0.0, 0, False
    sequence = []
    for d_elapsed, d_joined, arms in steps:
        elapsed, joined, armed = elapsed + d_elapsed, joined + d_joined, armed or arms
        sequence.append((elapsed, joined, armed))
    return sequence


@settings(max_examples=300, deadline=None)
@given(policies(), monotone_inputs())
def test_verdict_never_goes_backwards_and_never_forms_below_quorum(
    window_policy: WindowPolicy, inputs: list[tuple[float, int, bool]]
) -> None:
    phase = Phase.WAITING
    for elapsed, joined, armed in inputs:
        result = verdict(window_policy, phase, elapsed=elapsed, joined_ranks=joined, start_armed=armed)
        assert ORDER[result.phase] >= ORDER[phase]
        if result.phase is Phase.FORMING and phase is not Phase.FORMING:
            assert joined >= window_policy.quorum
        if phase is Phase.STAGING:
            assert result.phase is not Phase.WAITING
        phase = result.phase


@settings(max_examples=200, deadline=None)
@given(policies(), st.floats(0, 2000), st.integers(0, 20), st.booleans())
def test_verdict_events_replay_through_the_table(
    window_policy: WindowPolicy, elapsed: float, joined: int, armed: bool
) -> None:
    result = verdict(window_policy, Phase.WAITING, elapsed=elapsed, joined_ranks=joined, start_armed=armed)
    phase = Phase.WAITING
    for event in result.events:
        phase = advance(phase, event)
    assert phase is result.phase
    if elapsed >= window_policy.cap_secs:
        assert result.phase in (Phase.FORMING, Phase.FAILED)
