"""state.json's `attempt` (restarts): present only with restarts configured, each earlier attempt's cause."""

from __future__ import annotations

from typing import Any

from fdl.status import render

from flodld.controller.options import ControllerOptions
from flodld.controller.status.summary import attempt_texts
from flodld.membership.snapshot import EarlierAttempt, RunRecord, StateSnapshot


def _record(run_id: str, reason: str) -> RunRecord:
    return RunRecord(
        run_id=run_id, verdict="failed", reason=reason, started_at=1.0, formed_at=2.0, ended_at=3.0, ranks=2,
        hosts=["a", "b"], rank_exits=[],
    )  # fmt: skip


def test_without_restarts_there_is_no_attempt() -> None:
    assert ControllerOptions().attempt_state() is None


def test_an_attempt_names_its_number_its_bound_and_every_earlier_cause() -> None:
    earlier = (EarlierAttempt.of(_record("r1", "1 of 2 ranks failed (ranks [1])"), 1),)
    options = ControllerOptions(restart_count=1, max_restarts=2, earlier_attempts=earlier)
    state = options.attempt_state()
    assert state is not None
    assert state.model_dump(mode="json") == {
        "number": 2,
        "max_attempts": 3,
        "earlier": [
            {"number": 1, "run_id": "r1", "cause": "1 of 2 ranks failed (ranks [1])", "hosts": ["a", "b"]}
        ],
    }
    assert attempt_texts(state.model_dump(mode="json")) == [
        "attempt 2 of at most 3",
        "attempt 1 (run r1, hosts a, b) failed: 1 of 2 ranks failed (ranks [1])",
    ]
    # it validates as part of state.json's schema
    StateSnapshot.model_validate(
        {
            "phase": "training", "reason": "", "run_id": "r2", "controller": "h:1", "joined_ranks": 2,
            "joined_hosts": 2, "quorum": 2, "target": 2, "window_remaining_secs": None,
            "cap_remaining_secs": None, "start_mode": "auto", "start_armed": False, "startable": False,
            "members": [], "missing": [], "refused": {}, "rank_exits": [],
            "attempt": state.model_dump(mode="json"),
        }
    )  # fmt: skip
    assert attempt_texts(None) == []


def test_fdl_status_prints_the_attempt_under_the_phase() -> None:
    state: dict[str, Any] = {
        "phase": "training", "reason": "world formed", "run_id": "r2", "controller": "h:1", "joined_ranks": 2,
        "joined_hosts": 2, "quorum": 2, "target": 2, "members": [], "missing": [], "refused": {},
        "rank_exits": [], "attempt": {"number": 2, "max_attempts": 3, "earlier": []},
    }  # fmt: skip
    assert "  attempt 2 of at most 3" in render(state, "h:1").splitlines()
    earlier = {"number": 1, "run_id": "r1", "cause": "1 of 2 ranks failed", "hosts": ["a"]}
    lines = render({**state, "attempt": {**state["attempt"], "earlier": [earlier]}}, "h:1").splitlines()
    assert "    attempt 1 (run r1, hosts a) failed: 1 of 2 ranks failed" in lines
