"""The root-cause ordering (flodld/membership/rootcause.py): pure, no processes."""

from __future__ import annotations

import itertools

from flodld.membership.rootcause import Failure, RootCauseTracker, first_failure, headline


def _failure(rank: int, code: int, at: float, *, host: str = "a", torn_down: bool = False,
             error: str | None = None) -> Failure:  # fmt: skip
    return Failure(host=host, rank=rank, code=code, failed_at=at, torn_down=torn_down, error=error)


CULPRIT = _failure(1, 1, 100.000, host="a", error="RuntimeError: rank 1 fails on purpose")
SIBLING_TERMED = _failure(0, -15, 100.050, host="a", torn_down=True)  # its agent's SIGTERM
PEER_VICTIM = _failure(2, 1, 100.020, host="b", error="RuntimeError: Connection closed by peer")
PEER_TERMED = _failure(3, -15, 100.300, host="b", torn_down=True)  # the controller's Abort


def test_the_earliest_real_failure_wins_in_every_arrival_order() -> None:
    for order in itertools.permutations([CULPRIT, SIBLING_TERMED, PEER_VICTIM, PEER_TERMED]):
        tracker = RootCauseTracker()
        for failure in order:
            tracker.observe(failure)
        assert tracker.current is not None
        assert (tracker.current.host, tracker.current.rank) == ("a", 1), order
        assert tracker.failed == 4 and tracker.consequences == 2
        assert first_failure(list(order)) == CULPRIT


def test_a_torn_down_exit_is_never_the_root_cause_even_when_it_is_earliest() -> None:
    tracker = RootCauseTracker()
    tracker.observe(_failure(0, -15, 1.0, torn_down=True))
    assert tracker.current is None and tracker.state() is None
    tracker.observe(_failure(1, 1, 2.0))
    assert tracker.current is not None and tracker.current.rank == 1


def test_clean_exits_are_no_failures() -> None:
    tracker = RootCauseTracker()
    assert tracker.observe(_failure(0, 0, 1.0)) is False
    assert tracker.current is None and tracker.failed == 0


def test_ties_go_to_the_error_file_then_to_the_first_arrival() -> None:
    plain, recorded = _failure(4, 1, 5.0), _failure(5, 1, 5.0, error="ValueError: x")
    assert first_failure([plain, recorded]) == recorded
    tracker = RootCauseTracker()
    tracker.observe(_failure(7, 1, 5.0, host="b"))
    tracker.observe(_failure(6, 1, 5.0, host="a"))
    assert tracker.current is not None and tracker.current.rank == 7  # arrived first


def test_an_earlier_exit_wins_over_a_later_one_with_an_error_file() -> None:
    # No "close enough" window: the timestamps decide (docs/operations.md, "When a run fails").
    assert first_failure([_failure(2, 1, 1.002, error="E: late"), _failure(1, -9, 1.001)]).rank == 1  # type: ignore[union-attr]


def test_the_state_names_rank_host_exit_and_exception() -> None:
    tracker = RootCauseTracker()
    tracker.observe(
        Failure("a", 1, 1, 100.0, error="RuntimeError: boom\nmore", tail="Traceback\nRuntimeError: boom")
    )
    state = tracker.state()
    assert state is not None
    assert state["summary"] == "rank 1 on host 'a' (exit code 1): RuntimeError: boom"
    assert state["tail"] == ["Traceback", "RuntimeError: boom"] and state["exit"] == "exit code 1"
    assert headline(_failure(3, -9, 1.0, host="b")) == "rank 3 on host 'b' (signal 9)"
