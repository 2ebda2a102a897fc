"""Issue 18, the sans-io side: a storm of hellos costs no verdict per hello, yet the target still closes
the window at the exact hello; the world limit refuses at join; state.json pages and summarizes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import pytest

from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.membership import phase as phase_module
from flodld.membership.ledger import Ledger, Refused
from flodld.membership.phase import Phase
from flodld.membership.policy import MAX_WORLD_RANKS, PolicyError, derive_policy
from flodld.membership.snapshot import StateSnapshot
from flodld.membership.window import JoinWindow

from .helpers import hello, phase_of, policy

T0 = 10.0


def verdict_calls(operation: Callable[[], object]) -> int:
    count = 0

    def profiler(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event == "call" and frame.f_code is phase_module.verdict.__code__:
            count += 1

    sys.setprofile(profiler)
    try:
        operation()
    finally:
        sys.setprofile(None)
    return count


def test_deferred_hellos_skip_the_verdict_until_the_target_and_never_overshoot_it() -> None:
    w = JoinWindow(policy(capacity=1000, join_timeout=100), [], T0)
    calls = verdict_calls(lambda: [w.hello(hello(f"h{i:04d}"), T0 + 1, evaluate=False) for i in range(999)])
    assert calls == 0 and w.phase is Phase.WAITING and w.ledger.joined_ranks == 999
    assert verdict_calls(lambda: w.hello(hello("h0999"), T0 + 1, evaluate=False)) == 1
    assert phase_of(w) is Phase.FORMING  # the hello that reached the target closed the window at once
    late = w.hello(hello("late"), T0 + 1, evaluate=False)
    assert isinstance(late, Refused) and late.code == "window_closed"
    assert w.form(T0 + 2).world_size == 1000


def test_a_deferred_hello_after_the_window_expired_is_decided_by_the_clock_first() -> None:
    w = JoinWindow(policy(capacity=10, join_timeout=5, min_rank_start=1), [], T0)
    w.hello(hello("a"), T0 + 1, evaluate=False)
    late = w.hello(hello("b"), T0 + 6, evaluate=False)
    assert isinstance(late, Refused) and late.code == "window_closed"
    assert w.phase is Phase.FORMING and w.ledger.joined_ranks == 1


def test_a_host_past_the_world_limit_is_refused_with_world_full() -> None:
    ledger = Ledger(policy(capacity=8, target_ranks=8), max_world_ranks=4)
    assert ledger.admit(hello("a", devices=3), T0).ranks == (0, 1, 2)  # type: ignore[union-attr]
    refused = ledger.admit(hello("b", devices=2), T0)
    assert isinstance(refused, Refused) and refused.code == "world_full"
    assert "holds 3 of at most 4" in refused.reason
    assert ledger.admit(hello("c"), T0).ranks == (3,)  # type: ignore[union-attr]
    assert ledger.refused_counts == {"world_full": 1}
    with pytest.raises(ValueError, match="max_world_ranks"):
        Ledger(policy(capacity=1), max_world_ranks=MAX_WORLD_RANKS + 1)


def test_a_window_sized_past_the_world_limit_never_opens() -> None:
    join = JoinConfig(discovery=True, min_rank_start=1, target_ranks=MAX_WORLD_RANKS + 1)
    with pytest.raises(PolicyError, match="largest world"):
        derive_policy(join, capacity=0, loopback_bind=True, averaging=AveragingMode.CPU_SYNC)


def test_state_lists_one_page_and_counts_every_member() -> None:
    w = JoinWindow(policy(capacity=1800, join_timeout=100), [], T0)
    for i in range(1200):
        w.hello(hello(f"h{i:04d}", devices=1 + i % 2), T0 + 1, evaluate=False)
    state = w.state(T0 + 2)
    assert [m["host"] for m in state["members"]] == [f"h{i:04d}" for i in range(500)]
    assert state["members_page"] == {"start": 0, "stop": 500, "total": 1200}
    assert state["member_counts"] == {
        "by_link": {"open": 1200},
        "by_variant": {"cpu": 1200},
        "by_vendor": {"cpu": 1200},
    }
    page = w.state(T0 + 2, (1190, 5000))
    assert [m["host"] for m in page["members"]] == [f"h{i:04d}" for i in range(1190, 1200)]
    assert page["members"][-1]["ranks"] == [1798, 1799]
    assert page["members_page"] == {"start": 1190, "stop": 1200, "total": 1200}
    StateSnapshot.model_validate(page)  # the documented schema (docs/state-schema.json)
    assert w.state(T0 + 2, (5000, 6000))["members"] == []


def test_counts_and_generation_follow_retractions_links_and_exits() -> None:
    w = JoinWindow(policy(capacity=3, join_timeout=100), [], T0)
    seen = {w.generation}

    def changed() -> None:
        assert w.generation not in seen
        seen.add(w.generation)

    w.hello(hello("a"), T0 + 1)
    changed()
    w.hello(hello("b", devices=["cuda:0"]), T0 + 1)  # vendor_mix: a refusal is a change (refused counts)
    changed()
    w.hello(hello("b"), T0 + 1)
    changed()
    w.disconnect("a", T0 + 2)
    changed()
    assert w.state(T0 + 2)["member_counts"]["by_link"] == {"open": 1}
    assert [m["ranks"] for m in w.state(T0 + 2)["members"]] == [[0]]
    w.hello(hello("c", devices=2), T0 + 3)
    assert w.phase is Phase.FORMING
    w.form(T0 + 3)
    w.artifacts_shipped(T0 + 4)
    changed()
    w.host_closed("b", T0 + 5, lost=True)
    changed()
    w.rank_exited(1, 0, T0 + 6)
    changed()
    assert w.state(T0 + 6)["member_counts"]["by_link"] == {"lost": 1, "open": 1}
    before = w.generation
    w.tick(T0 + 7)
    assert w.generation == before  # nothing happened: the cache keeps its build
