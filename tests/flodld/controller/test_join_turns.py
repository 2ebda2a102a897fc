"""The join channel's per-turn budget: a storm of handshakes runs a bounded number of steps per event-loop
turn, so whatever else the loop serves (state.json, the store) waits for short turns, never for one step of
every dialer at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from flodld.net.turns import JOIN_STEPS_PER_TURN, TurnBudget, join_turns
from tests.flodld.controller.agents import TurnCounter


def _storm(budget: TurnBudget, steps: int) -> tuple[list[int], Counter[int]]:
    """`steps` steps handed to the budget in one turn; the order they ran in and how many ran per turn."""

    async def main() -> tuple[list[int], Counter[int]]:
        turns = TurnCounter()
        order: list[int] = []
        per_turn: Counter[int] = Counter()
        finished = asyncio.get_running_loop().create_future()

        def step(index: int) -> None:
            order.append(index)
            per_turn[turns.turn] += 1
            if len(order) == steps:
                finished.set_result(None)

        for index in range(steps):
            budget.call(lambda index=index: step(index))  # type: ignore[misc]
        await finished
        turns.stop()
        return order, per_turn

    return asyncio.run(main())


def test_a_storm_goes_through_a_few_steps_per_turn_in_arrival_order() -> None:
    budget = TurnBudget(8)
    order, per_turn = _storm(budget, 200)
    assert order == list(range(200))  # first come, first served
    assert order[:8] == list(range(8)) and per_turn[0] == 8  # the first turn's budget: taken at once
    assert max(per_turn.values()) <= 8  # never more than a turn's budget
    assert len(per_turn) >= 200 // 8  # spread over many turns, not all in one
    assert budget.deferred == 200 - 8


def test_a_quiet_loop_never_waits() -> None:
    async def main() -> tuple[int, int]:
        budget = TurnBudget(4)
        ran = 0

        def step() -> None:
            nonlocal ran
            ran += 1

        for _ in range(50):  # one step per turn: always within the budget, run at once
            budget.call(step)
            await asyncio.sleep(0)
        return ran, budget.deferred

    assert asyncio.run(main()) == (50, 0)


def test_a_failing_callback_step_is_logged_and_the_line_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[int]:
        budget = TurnBudget(1)
        done: list[int] = []

        def fail() -> None:
            raise RuntimeError("boom")

        budget.call(lambda: done.append(0))
        budget.call(fail)
        budget.call(lambda: done.append(2))
        for _ in range(5):
            await asyncio.sleep(0)
        return done

    assert asyncio.run(main()) == [0, 2]
    assert any("event=join_step_failed" in record.getMessage() for record in caplog.records)


def test_the_budget_is_one_per_loop_and_refuses_zero() -> None:
    async def both() -> tuple[TurnBudget, TurnBudget]:
        return join_turns(), join_turns()

    first, second = asyncio.run(both())
    assert first is second and first.per_turn == JOIN_STEPS_PER_TURN
    other, _ = asyncio.run(both())
    assert other is not first  # another loop, its own budget
    with pytest.raises(ValueError, match=">= 1"):
        TurnBudget(0)


@pytest.fixture
def fresh_heap() -> Iterator[None]:
    """A count of linked hosts of this test's own.

    The count is per process: links other tests of this process left open (or a storm they left spaced)
    must not count here, nor this test's links there.
    """
    import gc

    from flodld.controller.linkheap import LinkedHeap

    saved = (LinkedHeap.linked, LinkedHeap.admitted_since_freeze, LinkedHeap.froze, LinkedHeap.thresholds)
    threshold = gc.get_threshold()
    if LinkedHeap.thresholds is not None:
        gc.set_threshold(*LinkedHeap.thresholds)  # the collector's own pace, as outside a storm
    LinkedHeap.linked = LinkedHeap.admitted_since_freeze = 0
    LinkedHeap.froze, LinkedHeap.thresholds = False, None
    try:
        yield
    finally:
        LinkedHeap.linked, LinkedHeap.admitted_since_freeze, LinkedHeap.froze, LinkedHeap.thresholds = saved
        gc.set_threshold(*threshold)


def test_many_linked_hosts_are_frozen_out_of_the_collector_until_the_last_link_ends(
    monkeypatch: pytest.MonkeyPatch, fresh_heap: None
) -> None:
    import gc

    from flodld.controller import linkheap

    monkeypatch.setattr(linkheap, "FREEZE_EVERY", 3)
    gc.unfreeze()
    for _ in range(2):
        linkheap.link_opened()
    assert gc.get_freeze_count() == 0  # a few links: the collector is left alone
    linkheap.link_opened()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    for _ in range(2):
        linkheap.link_ended()
    # links still open: still frozen (the count itself may shrink: a frozen object freed by refcount, e.g.
    # by another thread of this process, leaves the permanent generation; only unfreeze empties it)
    assert linkheap.LinkedHeap.froze and gc.get_freeze_count() > 0
    linkheap.link_ended()
    assert gc.get_freeze_count() == 0  # the last link ended: everything back to the collector


def test_a_storm_of_linked_hosts_spaces_the_full_collections_until_the_last_link_ends(
    monkeypatch: pytest.MonkeyPatch, fresh_heap: None
) -> None:
    import gc

    from flodld.controller import linkheap

    monkeypatch.setattr(linkheap, "STORM_LINKS", 3)
    monkeypatch.setattr(linkheap, "FREEZE_EVERY", 1000)
    before = gc.get_threshold()
    try:
        for _ in range(2):
            linkheap.link_opened()
        assert gc.get_threshold() == before  # a few links: the collector's own pace
        linkheap.link_opened()
        spaced = gc.get_threshold()
        assert spaced[:2] == before[:2] and spaced[2] == before[2] * linkheap.FULL_COLLECTION_SPACING
        linkheap.link_opened()
        assert gc.get_threshold() == spaced  # spaced once, not again per link
        for _ in range(3):
            linkheap.link_ended()
        assert gc.get_threshold() == spaced  # links still open: still spaced
        linkheap.link_ended()
        assert gc.get_threshold() == before  # the last link ended: the collector's pace is back
    finally:
        gc.set_threshold(*before)
        linkheap.LinkedHeap.thresholds = None
