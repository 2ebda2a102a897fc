from __future__ import annotations

import json
from pathlib import Path

from flodld.membership.phase import Phase
from flodld.membership.snapshot import LinkState, StateSnapshot, render_state_schema, state_schema
from flodld.membership.window import JoinWindow
from tests.flodld.membership.helpers import hello, policy

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "5a17" * 8
T0 = 50.0


def test_docs_state_schema_is_the_generated_schema() -> None:
    stored = (ROOT / "docs" / "state-schema.json").read_text(encoding="utf-8")
    assert json.loads(stored) == state_schema(), (
        "regenerate with: python -m flodld.membership docs/state-schema.json"
    )
    assert stored == render_state_schema()


def test_countdowns_are_live_at_now_and_null_after_their_limit() -> None:
    w = JoinWindow(policy(capacity=2, join_timeout=100, max_join_timeout=200), [], T0)
    w.hello(hello("a"), T0 + 1)
    first, later = w.snapshot(T0 + 10), w.snapshot(T0 + 40)
    assert (first.window_remaining_secs, first.cap_remaining_secs) == (90.0, 190.0)
    assert (later.window_remaining_secs, later.cap_remaining_secs) == (60.0, 160.0)
    assert w.snapshot(T0 + 100).window_remaining_secs == 0.0
    assert w.snapshot(T0 + 150).window_remaining_secs is None
    assert w.snapshot(T0 + 150).cap_remaining_secs == 50.0


def test_countdowns_disappear_once_the_window_has_closed() -> None:
    w = JoinWindow(policy(capacity=1), [], T0)
    w.hello(hello("a"), T0 + 1)
    assert w.phase is Phase.FORMING
    snap = w.snapshot(T0 + 2)
    assert (snap.window_remaining_secs, snap.cap_remaining_secs, snap.startable) == (None, None, False)


def test_snapshot_reports_members_missing_workers_refusals_and_exits() -> None:
    w = JoinWindow(policy(capacity=3), ["a", "b", "c"], T0, run_id="run-9", controller="10.0.0.1:1337")
    w.hello(hello("b", 2, device_labels=["x86 core", "x86 core"]), T0 + 4)
    w.hello(hello("b"), T0 + 5)
    w.hello(hello("zz"), T0 + 5)
    snap = w.snapshot(T0 + 6)
    assert (snap.phase, snap.run_id, snap.controller) == (Phase.WAITING, "run-9", "10.0.0.1:1337")
    assert (snap.joined_ranks, snap.joined_hosts, snap.quorum, snap.target) == (2, 1, 3, 3)
    assert snap.missing == ["a", "c"]
    assert snap.refused == {"duplicate_host": 1, "unknown_host": 1}
    member = snap.members[0]
    assert (member.host, member.ranks, member.devices, member.joined_at_secs) == (
        "b",
        [0, 1],
        ["cpu:0", "cpu:1"],
        4.0,
    )
    assert member.device_labels == ["x86 core", "x86 core"]
    assert member.link is LinkState.OPEN
    w.hello(hello("a"), T0 + 7)
    w.form(T0 + 7)
    w.artifacts_shipped(T0 + 8)
    w.rank_exited(2, -9, T0 + 9)
    snap = w.snapshot(T0 + 9)
    assert snap.phase is Phase.FAILED
    assert [(e.rank, e.code) for e in snap.rank_exits] == [(2, -9)]
    assert "ranks [2]" in snap.reason


def test_startable_and_armed_follow_the_switch() -> None:
    w = JoinWindow(policy(capacity=1, start="manual"), [], T0)
    assert not w.snapshot(T0).startable
    w.hello(hello("a"), T0 + 1)
    snap = w.snapshot(T0 + 1)
    assert (snap.phase, snap.startable, snap.start_armed, snap.start_mode) == (
        Phase.STAGING,
        True,
        False,
        "manual",
    )
    w.arm_start(T0 + 2)
    assert w.snapshot(T0 + 2).start_armed


def test_snapshot_never_carries_the_token_and_round_trips() -> None:
    w = JoinWindow(policy(capacity=1, token=TOKEN), [], T0)
    w.hello(hello("a"), T0 + 1)
    text = w.snapshot(T0 + 1).model_dump_json()
    assert TOKEN not in text and "salt" not in text and "token" not in text
    assert StateSnapshot.model_validate_json(text) == w.snapshot(T0 + 1)
