"""The straggler clock's asyncio shell (`cpu_cadence`/`cpu_async` with a `straggler_timeout`): when a round
stops waiting for its late members, and, at the relay, the rounds the controller closed without them. The
rule is `flodld.fold.straggler.StragglerClock`'s. `RoundStragglers` arms and fires it for any fold (the
relay's over its ranks, the controller's data plane over hosts); `StragglerWatch` is the relay's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from flodld.fold.straggler import StragglerClock
from flodld.wire.data import Broadcast
from flodld.wire.errors import WireError

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.relay")

Member = TypeVar("Member", int, str)  # a relay's ranks, the controller's hosts (as StragglerClock)


class RoundStragglers(Generic[Member]):
    """Arms the clock of the round in progress and skips its late members when it is due.

    `ship` sends the chunks a skip completes (in the fold's order); `skipped(round, late)` says so (the
    shell's log line); `failed` is told why if shipping fails (None: the error is not caught). `clock`: the
    shell's clock (default the loop's).
    """

    def __init__(
        self,
        timeout: float | None,
        ship: Callable[[list[ChunkResult[Member]]], Awaitable[None]],
        *,
        skipped: Callable[[int, list[Member]], None],
        failed: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.clock = StragglerClock(timeout)
        self._ship: Callable[[list[ChunkResult[Member]]], Awaitable[None]] = ship
        self._skipped: Callable[[int, list[Member]], None] = skipped
        self._failed = failed
        self._now = clock
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def arm(self, barrier: RoundBarrier[Member], before: int) -> None:
        """After a member's chunk was taken: the round still open at `before` starts its straggler clock."""
        if self.clock.timeout is None or barrier.round != before or not barrier.started:
            return
        loop = asyncio.get_running_loop()
        now = self._now or loop.time
        wake = self.clock.arm(before, now())
        if wake is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(max(0.0, wake - now()), self._due, barrier, before)

    def _due(self, barrier: RoundBarrier[Member], round_number: int) -> None:
        """The timer: skip the members that still owe `round_number`, if it is still open."""
        self._timer = None
        loop = asyncio.get_running_loop()
        late = self.clock.late(barrier, round_number, (self._now or loop.time)())
        if late is None:
            return
        self._skipped(round_number, late)
        sending = self._ship(barrier.skip(late))

        async def ship() -> None:
            try:
                await sending
            except (OSError, WireError) as error:
                if self._failed is None:
                    raise
                self._failed(f"controller data channel failed: {error}")

        task = loop.create_task(ship())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class StragglerWatch(RoundStragglers[int]):
    """The relay's: over its local ranks, logging the late chunks its fold drops, and closing the rounds the
    controller finished without this host (`closed_above`).
    """

    def __init__(
        self,
        timeout: float | None,
        ship: Callable[[list[ChunkResult[int]]], Awaitable[None]],
        failed: Callable[[str], None],
    ) -> None:
        super().__init__(timeout, ship, skipped=self._log_skipped, failed=failed)
        self._late_logged = 0  # late chunks dropped, as last logged

    def watch(self, barrier: RoundBarrier[int], before: int, rank: int) -> None:
        """After `rank`'s chunk was taken: log a late chunk the fold dropped, and `arm`."""
        if barrier.late_chunks != self._late_logged:
            self._late_logged = barrier.late_chunks
            log.info(
                "relay: dropped rank %d's late deposit chunk (its round closed without it; %d so far)",
                rank,
                barrier.late_chunks,
            )
        self.arm(barrier, before)

    def _log_skipped(self, round_number: int, late: list[int]) -> None:
        log.warning(
            "relay: round %d closes without rank(s) %s: no deposit %gs after its first (straggler_timeout)",
            round_number,
            late,
            self.clock.timeout,
        )

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
