"""The relay's straggler clock (`cpu_cadence`/`cpu_async` with a `straggler_timeout`): when a round of
its local ranks stops waiting for the late ones, and the rounds the controller closed without them.
The rule is `flodld.fold.straggler.StragglerClock`'s; this is its asyncio shell at the relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from flodld.fold.straggler import StragglerClock
from flodld.wire.data import Broadcast
from flodld.wire.errors import WireError

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.relay")


class StragglerWatch:
    """Arms the clock of the round in progress and skips its late ranks when it is due.

    `ship` sends the chunks a skip completes (in the fold's order); `failed` is told why, if that fails.
    """

    def __init__(
        self,
        timeout: float | None,
        ship: Callable[[list[ChunkResult[int]]], Awaitable[None]],
        failed: Callable[[str], None],
    ) -> None:
        self.clock = StragglerClock(timeout)
        self._ship = ship
        self._failed = failed
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._late_logged = 0  # late chunks dropped, as last logged

    def watch(self, barrier: RoundBarrier[int], before: int, rank: int) -> None:
        """After `rank`'s chunk was taken: the round still open at `before` starts its straggler clock."""
        if barrier.late_chunks != self._late_logged:
            self._late_logged = barrier.late_chunks
            log.info(
                "relay: dropped rank %d's late deposit chunk (its round closed without it; %d so far)",
                rank,
                barrier.late_chunks,
            )
        if self.clock.timeout is None or barrier.round != before or not barrier.started:
            return
        loop = asyncio.get_running_loop()
        wake = self.clock.arm(before, loop.time())
        if wake is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(wake, self._due, barrier, before)

    def _due(self, barrier: RoundBarrier[int], round_number: int) -> None:
        """The timer: skip the ranks that still owe `round_number`, if it is still open."""
        self._timer = None
        loop = asyncio.get_running_loop()
        late = self.clock.late(barrier, round_number, loop.time())
        if late is None:
            return
        log.warning(
            "relay: round %d closes without rank(s) %s: no deposit %gs after its first (straggler_timeout)",
            round_number,
            late,
            self.clock.timeout,
        )
        sending = self._ship(barrier.skip(late))

        async def ship() -> None:
            try:
                await sending
            except (OSError, WireError) as error:
                self._failed(f"controller data channel failed: {error}")

        task = loop.create_task(ship())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def closed_above(self, barrier: RoundBarrier[int] | None, message: Broadcast, nbytes: int) -> None:
        """The controller finished `message.round` (its last chunk is here): a round this relay still
        folds is over without the local ranks still owing it (the controller skipped this host). Their
        partial fold is dropped, and the ranks' next deposits find the next round open.
        """
        if self.clock.timeout is None or barrier is None or barrier.round > message.round:
            return
        if message.offset + nbytes != sum(spec.nbytes() for spec in message.tensors):
            return
        while barrier.round <= message.round:
            late = sorted(barrier.waiting_for)
            log.warning(
                "relay: round %d closed at the controller without rank(s) %s (straggler_timeout)",
                barrier.round,
                late,
            )
            open_round = barrier.round
            barrier.skip(late)  # chunks it completes are not shipped: the controller has the round
            if barrier.round == open_round:  # pragma: no cover - skip closes a round nobody owes
                break
