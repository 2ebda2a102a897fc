"""Deadlines of one length on one loop timer: each runs when its own `call_later` would have, in order,
unless cancelled; cancelled ones hold nothing and cost no callback.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from flodld.net.deadlines import DeadlineQueue


async def test_each_deadline_runs_its_timeout_after_it_was_set_in_the_order_they_were_set() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop, 0.05)
    fired: list[tuple[int, float]] = []
    set_at: list[float] = []
    for index in range(5):
        set_at.append(loop.time())
        queue.call(lambda index=index: fired.append((index, loop.time())))  # type: ignore[misc]
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert [index for index, _ in fired] == [0, 1, 2, 3, 4]
    for (_, at), began in zip(fired, set_at, strict=True):
        assert at >= began + 0.05  # never early (the loop's clock, as call_later's)
    assert len(queue) == 0


async def test_a_cancelled_deadline_never_runs_and_the_rest_still_do() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop, 0.03)
    fired: list[int] = []
    deadlines = [queue.call(lambda index=index: fired.append(index)) for index in range(6)]  # type: ignore[misc]
    for index in (0, 2, 3, 5):  # the head among them: the timer armed for it must still serve the others
        deadlines[index].cancel()
    assert deadlines[0].cancelled() and not deadlines[1].cancelled()
    await asyncio.sleep(0.08)
    assert fired == [1, 4]
    assert deadlines[1].cancelled()  # called: cancelling now does nothing
    deadlines[1].cancel()
    assert fired == [1, 4]


async def test_a_cancelled_deadline_lets_go_of_what_its_callback_held_at_once() -> None:
    class Owner:
        def expire(self) -> None:
            raise AssertionError("cancelled: never called")

    queue = DeadlineQueue(asyncio.get_running_loop(), 60)
    owner = Owner()
    held = weakref.ref(owner)
    deadline = queue.call(owner.expire)
    deadline.cancel()
    del owner
    gc.collect()
    assert held() is None  # not kept alive for the 60 s until its entry reaches the head
    queue.close()


async def test_a_queue_that_ran_dry_arms_its_timer_again_for_the_next_deadline() -> None:
    queue = DeadlineQueue(asyncio.get_running_loop(), 0.02)
    fired: list[str] = []
    queue.call(lambda: fired.append("first"))
    await asyncio.sleep(0.05)
    queue.call(lambda: fired.append("second"))
    await asyncio.sleep(0.05)
    assert fired == ["first", "second"]


async def test_a_failing_callback_is_logged_and_the_others_run(caplog: pytest.LogCaptureFixture) -> None:
    queue = DeadlineQueue(asyncio.get_running_loop(), 0.01)
    fired: list[int] = []

    def fail() -> None:
        raise RuntimeError("boom")

    queue.call(lambda: fired.append(0))
    queue.call(fail)
    queue.call(lambda: fired.append(2))
    await asyncio.sleep(0.05)
    assert fired == [0, 2]
    assert any("event=deadline_callback_failed" in record.getMessage() for record in caplog.records)


async def test_close_cancels_every_deadline() -> None:
    queue = DeadlineQueue(asyncio.get_running_loop(), 0.01)
    fired: list[int] = []
    deadlines = [queue.call(lambda: fired.append(1)) for _ in range(3)]
    queue.close()
    await asyncio.sleep(0.04)
    assert fired == [] and all(deadline.cancelled() for deadline in deadlines) and len(queue) == 0


def test_a_deadline_queue_needs_a_positive_timeout() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="> 0"):
            DeadlineQueue(loop, 0)
    finally:
        loop.close()
