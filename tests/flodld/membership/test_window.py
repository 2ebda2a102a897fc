from __future__ import annotations

from typing import Any

import pytest

from flodld.membership.ledger import Admitted, Refused
from flodld.membership.phase import Phase, TransitionError
from flodld.membership.snapshot import LinkState
from flodld.membership.switch import Armed, StartRefused
from flodld.membership.window import JoinWindow, LinkOutcome
from tests.flodld.membership.helpers import hello, policy

T0 = 1000.0  # an arbitrary monotonic origin: nothing may assume the clock starts at zero


def window(
    roster: list[str] | None = None,
    capacity: int = 2,
    tolerance: int = 0,
    **knobs: Any,  # noqa: ANN401  the `controller.join` knobs, passed on to policy()
) -> JoinWindow:
    return JoinWindow(
        policy(capacity=capacity, **knobs),
        roster or [],
        T0,
        run_id="run-7",
        controller="127.0.0.1:1337",
        tolerance=tolerance,
    )


def join(w: JoinWindow, host: str, devices: int = 1, at: float = 1.0) -> tuple[int, ...]:
    outcome = w.hello(hello(host, devices), T0 + at)
    assert isinstance(outcome, Admitted), outcome
    return outcome.ranks


def run_to_training(w: JoinWindow, at: float = 2.0) -> None:
    assert w.tick(T0 + at) is Phase.FORMING
    w.form(T0 + at)
    assert w.artifacts_shipped(T0 + at) is Phase.TRAINING


def training_window() -> JoinWindow:
    """Roster a and b, both joined with one rank each, the window run to TRAINING at T0 + 2."""
    w = window(["a", "b"])
    join(w, "a")
    join(w, "b")
    run_to_training(w)
    return w


def test_fan_out_run_closes_on_full_roster_and_ends_done() -> None:
    w = window(["a", "b"])
    join(w, "a")
    assert w.phase is Phase.WAITING
    join(w, "b", at=1.5)
    assert w.tick(T0 + 1.5) is Phase.FORMING
    world = w.form(T0 + 2)
    assert (world.hosts, world.world_size) == (("a", "b"), 2)
    assert w.artifacts_shipped(T0 + 3) is Phase.TRAINING
    w.rank_exited(0, 0, T0 + 10)
    w.rank_exited(1, 0, T0 + 10)
    assert w.host_closed("a", T0 + 11) is Phase.TRAINING
    assert w.host_closed("b", T0 + 11) is Phase.DONE
    assert w.links == {"a": LinkState.CLOSED, "b": LinkState.CLOSED}


def test_quorum_reached_early_keeps_an_auto_window_open_for_late_joiners() -> None:
    w = window(capacity=4, min_rank_start=1, target_ranks=4, join_timeout=100)
    join(w, "a", at=1)
    assert w.tick(T0 + 50) is Phase.WAITING
    join(w, "b", at=60)
    assert w.tick(T0 + 100) is Phase.FORMING
    assert w.form(T0 + 100).hosts == ("a", "b")


def test_disconnect_before_formation_returns_ranks_and_renumbers() -> None:
    w = window(capacity=5, min_rank_start=5)
    join(w, "a", 1)
    join(w, "b", 2)
    join(w, "c", 1)
    assert w.disconnect("b", T0 + 3) == (1, 2)
    assert [(m.host, m.ranks) for m in w.snapshot(T0 + 3).members] == [("a", [0]), ("c", [1])]
    assert join(w, "d", 3) == (2, 3, 4)
    assert w.phase is Phase.FORMING


def test_manual_window_holds_through_expiry_until_start() -> None:
    w = window(capacity=2, start="manual", join_timeout=10, max_join_timeout=100)
    join(w, "a")
    join(w, "b")
    assert w.phase is Phase.STAGING
    assert w.tick(T0 + 50) is Phase.STAGING
    join(w, "late", at=60)  # the hold still admits joiners
    decision = w.arm_start(T0 + 70)
    assert decision == Armed(joined_ranks=3, quorum=2, already=False)
    assert w.tick(T0 + 70) is Phase.FORMING
    again = w.arm_start(T0 + 71)
    assert isinstance(again, StartRefused) and again.code == "window_closed"


def test_manual_start_below_quorum_is_refused_not_queued() -> None:
    w = window(capacity=2, start="manual")
    join(w, "a")
    refused = w.arm_start(T0 + 2)
    assert isinstance(refused, StartRefused) and refused.code == "quorum_not_met"
    assert not w.start_armed
    join(w, "b", at=3)
    assert w.phase is Phase.STAGING  # quorum now met, but nothing was queued


def test_manual_with_quorum_never_started_fails_at_the_cap() -> None:
    w = window(capacity=1, start="manual", join_timeout=10, max_join_timeout=20)
    join(w, "a")
    assert w.tick(T0 + 20) is Phase.FAILED
    assert "operator start not received" in w.reason


def test_hard_cap_below_quorum_fails_and_later_joins_are_refused() -> None:
    w = window(capacity=2)
    join(w, "a")
    assert w.tick(T0 + 600) is Phase.FAILED
    assert w.reason == "quorum not met: 1 of 2 ranks joined after 600s hard cap"
    outcome = w.hello(hello("b"), T0 + 601)
    assert isinstance(outcome, Refused) and outcome.code == "window_closed"
    assert w.snapshot(T0 + 601).refused == {"window_closed": 1}


def test_a_join_after_the_cap_is_judged_at_its_own_time() -> None:
    w = window(capacity=1)
    outcome = w.hello(hello("a"), T0 + 700)
    assert isinstance(outcome, Refused) and outcome.code == "window_closed"
    assert w.phase is Phase.FAILED


def test_rank_failure_beyond_tolerance_fails_the_run() -> None:
    w = training_window()
    assert w.rank_exited(1, -9, T0 + 5) is Phase.FAILED
    assert "over the tolerance of 0" in w.reason


def test_exits_after_the_verdict_are_recorded_but_change_nothing() -> None:
    w = training_window()
    assert w.rank_exited(1, -6, T0 + 5) is Phase.FAILED
    reason = w.reason
    assert w.rank_exited(0, -15, T0 + 6) is Phase.FAILED  # torn down after the failure
    assert w.rank_exited(1, 0, T0 + 7) is Phase.FAILED  # a duplicate report keeps the first code
    assert w.reason == reason
    assert [(e.rank, e.code) for e in w.snapshot(T0 + 8).rank_exits] == [(0, -15), (1, -6)]


def test_rank_failure_within_tolerance_finishes_degraded() -> None:
    w = window(["a", "b"], tolerance=1)
    join(w, "a")
    join(w, "b")
    run_to_training(w)
    w.rank_exited(0, 0, T0 + 5)
    assert w.rank_exited(1, 3, T0 + 5) is Phase.TRAINING
    w.host_closed("a", T0 + 6)
    assert w.host_closed("b", T0 + 6) is Phase.DONE
    assert "degraded" in w.reason


def test_a_degraded_run_names_each_lost_rank_its_host_cause_and_round() -> None:
    w = window(["a", "b"], capacity=3, tolerance=1)
    join(w, "a", devices=2)
    join(w, "b")
    run_to_training(w)
    assert w.rank_exited(1, -9, T0 + 5, in_round=7) is Phase.TRAINING
    w.rank_exited(0, 0, T0 + 6)
    w.rank_exited(2, 0, T0 + 6)
    w.host_closed("a", T0 + 6)
    assert w.host_closed("b", T0 + 6) is Phase.DONE
    assert w.reason == (
        "every host link closed (degraded: ranks [1] lost: rank 1 on 'a' exited with signal 9 in round 7)"
    )
    assert w.state(T0 + 7)["losses"] == [
        {"rank": 1, "host": "a", "cause": "exited with signal 9", "round": 7, "at_secs": 5.0}
    ]
    assert [loss.rank for loss in w.snapshot(T0 + 7).losses] == [1]


def test_a_rank_declared_dead_fails_alone_and_beyond_the_tolerance_fails_the_run() -> None:
    w = window(["a", "b"], capacity=3, tolerance=1)
    join(w, "a", devices=2)
    join(w, "b")
    run_to_training(w)
    assert w.rank_declared_dead(0, T0 + 5, why="silent for 5s", in_round=3) is Phase.TRAINING
    assert w.links["a"] is LinkState.OPEN  # its host stays
    w.rank_exited(0, -9, T0 + 6)  # the agent killed it: nothing more
    assert w.losses[0].cause == "declared dead: silent for 5s"
    assert w.rank_exited(2, 1, T0 + 7) is Phase.FAILED
    assert "2 of 3 ranks failed (ranks [0, 2]), over the tolerance of 1" in w.reason


@pytest.mark.parametrize(
    ("percent", "world", "tolerated"), [(50.0, 3, 1), (25.0, 8, 2), (33.333, 3, 0), (100.0, 2, 2)]
)
def test_a_tolerance_as_a_share_of_the_world_is_a_count_once_it_forms(
    percent: float, world: int, tolerated: int
) -> None:
    w = JoinWindow(policy(capacity=world), [], T0, tolerance_percent=percent)
    join(w, "a", devices=world)
    run_to_training(w)
    assert w.tolerance == tolerated


def test_a_lost_hosts_unreported_ranks_are_named_with_its_cause() -> None:
    w = window(["a", "b"], tolerance=1)
    join(w, "a")
    join(w, "b")
    run_to_training(w)
    w.link_ended("b", T0 + 5, clean=False, why="connection reset")
    assert w.phase is Phase.TRAINING
    assert w.losses[1].sentence() == "rank 1 on 'b' lost with its host: connection reset"


def test_a_link_lost_before_its_ranks_reported_counts_them_failed() -> None:
    w = training_window()
    assert w.disconnect("b", T0 + 5) == (1,)
    assert w.links["b"] is LinkState.LOST
    assert w.phase is Phase.FAILED
    assert w.failed_ranks() == [1]


def test_links_closing_while_forming_settle_once_training_starts() -> None:
    w = window(["a"], capacity=1)
    join(w, "a")
    w.tick(T0 + 2)
    w.form(T0 + 2)
    w.rank_exited(0, 0, T0 + 3)
    w.host_closed("a", T0 + 3)
    assert w.phase is Phase.FORMING
    assert w.artifacts_shipped(T0 + 4) is Phase.DONE


@pytest.mark.parametrize("stage", ["waiting", "staging", "forming", "training"])
def test_abort_fails_every_open_phase(stage: str) -> None:
    w = window(capacity=2, start="manual")
    if stage != "waiting":
        join(w, "a")
        join(w, "b")
    if stage in ("forming", "training"):
        w.arm_start(T0 + 2)
        w.form(T0 + 2)
    if stage == "training":
        w.artifacts_shipped(T0 + 3)
    assert w.phase.value == stage
    assert w.abort("controller shutting down", T0 + 4) is Phase.FAILED
    assert w.reason == "controller shutting down"


def test_abort_after_done_changes_nothing() -> None:
    w = window(["a"], capacity=1)
    join(w, "a")
    run_to_training(w)
    w.rank_exited(0, 0, T0 + 3)
    w.host_closed("a", T0 + 3)
    assert w.abort("late", T0 + 4) is Phase.DONE


def test_out_of_order_calls_are_refused() -> None:
    w = window(capacity=2)
    with pytest.raises(TransitionError, match="waiting"):
        w.form(T0)
    with pytest.raises(TransitionError, match="form"):
        w.artifacts_shipped(T0)
    with pytest.raises(ValueError, match="rank 0 is not in the formed world"):
        w.rank_exited(0, 0, T0)
    with pytest.raises(ValueError, match="tolerance"):
        JoinWindow(policy(), [], T0, tolerance=-1)


def test_formation_wait_is_the_rest_of_the_cap() -> None:
    w = window(capacity=2)
    assert w.formation_wait_secs(T0 + 100) == 500.0
    assert w.formation_wait_secs(T0 + 900) == 0.0


def test_a_link_dropping_between_verdict_and_form_is_lost_in_the_world() -> None:
    w = window(["a", "b"])
    join(w, "a")
    join(w, "b")
    assert w.phase is Phase.FORMING
    assert w.disconnect("b", T0 + 2) == (1,)
    assert w.world is not None and w.world.hosts == ("a", "b")
    assert w.links["b"] is LinkState.LOST
    assert w.artifacts_shipped(T0 + 3) is Phase.FAILED  # tolerance 0: rank 1 never reported


def test_links_closing_after_a_failed_window_are_harmless() -> None:
    w = window(capacity=2)
    join(w, "a")
    w.tick(T0 + 600)
    assert w.disconnect("a", T0 + 601) == (0,)
    assert w.phase is Phase.FAILED


def test_a_clean_link_eof_is_the_host_exit_event_even_without_rank_reports() -> None:
    w = training_window()
    w.host_closed("a", T0 + 5)
    assert w.host_closed("b", T0 + 6) is Phase.DONE
    assert w.links == {"a": LinkState.CLOSED, "b": LinkState.CLOSED}
    assert w.failed_ranks() == []


def test_a_broken_link_is_lost_and_its_unreported_ranks_failed() -> None:
    w = window(["a", "b"], capacity=3, tolerance=1)
    join(w, "a")
    join(w, "b", 2)
    run_to_training(w)
    w.rank_exited(1, 0, T0 + 4)
    assert w.host_closed("b", T0 + 5, lost=True) is Phase.TRAINING  # one unreported rank, within tolerance
    assert (w.links["b"], w.failed_ranks()) == (LinkState.LOST, [2])


def test_the_core_decides_what_a_link_end_means_before_and_after_formation() -> None:
    w = window(["a", "b", "c"], capacity=3, tolerance=1)
    join(w, "a")
    join(w, "b")
    ended = w.link_ended("b", T0 + 1.5, clean=True, why="host closed its join link")
    assert (ended.outcome, ended.ranks) == (
        LinkOutcome.RETURNED,
        (1,),
    )  # before formation: its rank goes back
    join(w, "b", at=1.6)
    join(w, "c", at=1.7)
    run_to_training(w)
    w.rank_exited(0, 0, T0 + 3)
    clean = w.link_ended("a", T0 + 4, clean=True, why="host closed its join link")
    assert (clean.outcome, w.links["a"], w.loss_reasons) == (LinkOutcome.CLOSED, LinkState.CLOSED, {})
    # A clean FIN with a rank unreported is a dead agent: lost, and the reason says which ranks.
    dead = w.link_ended("b", T0 + 5, clean=True, why="host closed its join link")
    assert dead.outcome is LinkOutcome.LOST and dead.ranks == (1,)
    assert w.loss_reasons == {"b": "host closed its join link with rank(s) [1] unreported"}
    assert (w.links["b"], w.failed_ranks(), w.phase) == (
        LinkState.LOST,
        [1],
        Phase.TRAINING,
    )  # within tolerance
    assert w.final_reason == w.reason  # a run that has not failed names no lost link
    broken = w.link_ended("c", T0 + 6, clean=False, why="join link broke: ConnectionResetError()")
    assert broken.outcome is LinkOutcome.LOST and w.phase is Phase.FAILED
    assert "over the tolerance of 1" in w.reason and "lost join link" not in w.reason
    assert w.final_reason == (
        f"{w.reason} — lost join link(s): host 'b': host closed its join link with rank(s) [1] unreported; "
        "host 'c': join link broke: ConnectionResetError()"
    )
    assert (
        w.link_ended("c", T0 + 7, clean=True, why="late").outcome is LinkOutcome.IGNORED
    )  # after the verdict


def test_a_loss_reason_is_kept_once_named_by_its_first_cause() -> None:
    w = window(["a", "b"], capacity=2, tolerance=1)
    join(w, "a")
    join(w, "b")
    run_to_training(w)
    w.host_closed(
        "a", T0 + 3, lost=True, why="no heartbeat for 6s"
    )  # a subsystem: named in the verdict itself
    w.link_ended("a", T0 + 4, clean=False, why="join link broke")
    assert w.loss_reasons == {"a": "no heartbeat for 6s"}
    w.abort("stopped by the operator", T0 + 5)
    assert w.final_reason == "stopped by the operator"  # no join link was the cause


def test_a_degraded_verdict_names_the_first_losses_and_counts_the_rest() -> None:
    w = window(["a"], capacity=8, tolerance=7)
    join(w, "a", devices=8)
    run_to_training(w)
    for rank in range(7):
        w.rank_exited(rank, 1, T0 + 5)
    w.rank_exited(7, 0, T0 + 5)
    assert w.host_closed("a", T0 + 6) is Phase.DONE
    assert w.reason.count("exited with code 1") == 5
    assert w.reason.endswith("; and 2 more (state.json losses))"), w.reason
    assert len(w.state(T0 + 7)["losses"]) == 7


def test_the_relays_round_corrects_a_loss_recorded_with_an_estimate_and_holds_for_a_later_one() -> None:
    w = window(["a"], capacity=3, tolerance=2)
    join(w, "a", devices=3)
    run_to_training(w)
    w.rank_exited(1, -9, T0 + 5, in_round=0)  # the exit report came first, with a stale estimate
    w.correct_loss_round(1, 3)
    w.correct_loss_round(2, 4)  # the relay's word came first
    w.rank_exited(2, -9, T0 + 6, in_round=1)
    assert [(x["rank"], x["round"]) for x in w.state(T0 + 7)["losses"]] == [(1, 3), (2, 4)]
