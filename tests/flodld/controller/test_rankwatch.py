"""RankWatch's ticker: a silent rank is declared dead at its deadline, not at the next coordinator beat.

A real event loop and clock; the relays are recorders (the plane's socket paths have their own tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from flodld.controller.rankwatch import RankWatch
from flodld.net.stream import FramedStream
from flodld.wire.control import CoordinatorHeartbeat
from flodld.wire.messages import Message

Dead = list[tuple[int, str, float]]


def _watch(
    timeout: float, interval: float, relays: dict[str, FramedStream]
) -> tuple[RankWatch, list[Message], Dead]:
    sent: list[Message] = []
    dead: Dead = []

    async def send(stream: FramedStream, message: Message) -> None:
        sent.append(message)

    async def rank_left(host: str, rank: int, reason: str) -> None:
        dead.append((rank, reason, time.monotonic()))

    watch = RankWatch(
        {0: "a", 1: "a"},
        relays,
        timeout=timeout,
        startup=None,
        interval=interval,
        clock=time.monotonic,
        send=send,
        rank_left=rank_left,
        round_in_progress=lambda rank: 7,
    )
    return watch, sent, dead


async def _rank_1_speaks(watch: RankWatch, *, until: Callable[[], bool], seconds: float) -> None:
    """Rank 1's heartbeats every 10 ms, for `seconds` or until `until()`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        watch.liveness.heard(1, time.monotonic())
        await asyncio.sleep(0.01)


def test_a_silent_rank_is_declared_dead_at_its_deadline_not_at_the_next_beat() -> None:
    async def main() -> tuple[list[tuple[int, str, float]], float]:
        watch, _, dead = _watch(timeout=0.3, interval=60.0, relays={})
        started = time.monotonic()
        watch.start()
        await _rank_1_speaks(watch, until=lambda: len(dead) == 1, seconds=5.0)  # rank 0 never does
        await watch.close()
        return dead, started

    dead, started = asyncio.run(main())
    assert [rank for rank, _, _ in dead] == [0]
    assert "rank 0 on 'a' sent no heartbeat for 0.3s (round 7 in progress)" in dead[0][1]
    assert dead[0][2] - started < 5.0  # the beat is every 60 s: the deadline woke the ticker


def test_the_coordinator_beat_keeps_its_interval_while_deadlines_wake_the_ticker() -> None:
    async def main() -> tuple[list[Message], list[tuple[int, str, float]]]:
        watch, sent, dead = _watch(timeout=0.05, interval=0.2, relays={"a": object()})  # type: ignore[dict-item]
        watch.start()
        await _rank_1_speaks(watch, until=lambda: False, seconds=1.1)  # its deadline moves ~20 times a beat
        await watch.close()
        return sent, dead

    sent, dead = asyncio.run(main())
    assert [rank for rank, _, _ in dead] == [0]
    beats = [message for message in sent if isinstance(message, CoordinatorHeartbeat)]
    # A beat per 0.2 s (fewer on a starved loop, never more): the deadline wakes between beats sent none.
    assert 1 <= len(beats) <= 6
