"""The relay's fold of its local ranks' deposits, chunk by chunk (`flodld.fold.barrier`), and where each
completed chunk goes: up to the controller as a HostFrame, sealed straight from the accumulator, or, on the
world's only host (`sole_host`), finished here and delivered to the ranks. Completed chunks leave in the
order the fold made them, whichever task made them (a deposit's handler, a leg closing, the straggler
timer: `flodld.net.inorder`). Folding needs torch; it loads, in a worker thread, with the first deposit or
region offer, so a relay used only for liveness (gloo/nccl collectives) never imports it, and the import
never stalls the loop that forwards the ranks' heartbeats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from flodld.fold import round_barrier
from flodld.net.inorder import InOrder
from flodld.net.stream import FramedStream
from flodld.relay.delivery import Delivery, send_quietly
from flodld.relay.entry import WalkInEntry
from flodld.relay.foldload import FoldLoad
from flodld.relay.stragglers import StragglerWatch
from flodld.wire.data import Broadcast, DataPlaneError, Deposit, HostFrame, ShmDeposit

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.relay")

ChunkMessage = TypeVar("ChunkMessage", HostFrame, Broadcast)
Take = Callable[[], tuple[memoryview, Callable[[], None]]]
"""A chunk's bytes and what gives them back once folded (a frame's buffer, a region's loan)."""


def chunk_message(kind: type[ChunkMessage], result: ChunkResult[int]) -> ChunkMessage:
    """The header of a completed chunk, as a HostFrame (up) or a Broadcast (to the ranks)."""
    return kind(
        round=result.round,
        fold=result.fold_spec,
        weight=result.weight,
        contributors=sorted(result.contributors),
        tensors=list(result.specs),
        offset=result.offset,
    )


class DepositFold:
    """The fold of `ranks`' deposits (`gone`: the relay's set of ranks that left, read as it grows;
    `entry`: a walk-in's, whose round the fold starts at).

    `upstream` is the DATA channel to the controller once dialed; `failed` is told why it failed, when a
    straggler skip's chunks could not be sent.
    """

    def __init__(
        self,
        ranks: Collection[int],
        gone: set[int],
        entry: WalkInEntry,
        down: Delivery,
        *,
        straggler_timeout: float | None,
        failed: Callable[[str], None],
    ) -> None:
        self._ranks = set(ranks)
        self._gone = gone
        self._entry = entry
        self._down = down
        self.barrier: RoundBarrier[int] | None = None
        self.sole_host = False  # the controller says so in its DATA HelloAck: fold and broadcast here
        self.failed_round: str | None = None  # why the sole host's fold could not finish a round
        self.refused = 0  # deposits refused, and rounds the sole host could not finish
        self.upstream: FramedStream | None = None
        self._outbox = InOrder()
        self._fold = FoldLoad()  # the fold's import, in a worker thread
        # cpu_cadence/cpu_async with a straggler_timeout: when a round stops waiting for its late ranks.
        self.stragglers = StragglerWatch(straggler_timeout, ship=self.send, failed=failed)

    def ensure(self) -> RoundBarrier[int]:
        if self.barrier is None:
            # A sole host broadcasts from its accumulator as the controller does, so it keeps two (a rank
            # that has all of a round may deposit the next while a send to a slower rank still reads it).
            live = self._ranks - self._gone
            self.barrier = round_barrier(live, accumulators=2 if self.sole_host else 1)
            if self._entry.entry is not None:  # a walk-in: its first round is the one it entered at
                self.barrier.begin_at(self._entry.entry.round)
        return self.barrier

    def preload(self) -> None:
        """Start loading the fold (torch) now, in a worker thread: a walk-in's relay, whose host must fold
        the moment it enters, or the round it entered waits for the import (seconds on a loaded host).
        """
        self._fold.start()

    async def loaded(self) -> None:
        """Once the fold is loaded (in a worker thread, started now if `preload` did not start it): the loop
        that folds also forwards the ranks' heartbeats, and the import takes seconds on a loaded host.
        """
        await self._fold.ready()

    async def ready(self) -> RoundBarrier[int]:
        """`ensure`, the fold loaded first (`loaded`)."""
        if self.barrier is None:
            await self.loaded()
        return self.ensure()

    def send(self, results: list[ChunkResult[int]]) -> Coroutine[Any, Any, None]:
        """A coroutine that ships `results`, in the fold's order: it takes its place now, before any await."""
        return self._outbox.send(results, self._ship)

    async def deposit(
        self, rank: int, stream: FramedStream, message: Deposit | ShmDeposit, take: Take
    ) -> bool:
        """Fold a chunk of `rank`'s deposit (its bytes and their release from `take`); ship every chunk it
        completes. Any decode or fold failure refuses this rank, never kills the relay: True, the leg stops.
        """
        barrier = await self.ready()
        if rank in self._gone:  # it left while torch loaded: nothing of it is folded
            return True
        if self.failed_round is not None:
            await send_quietly(stream, DataPlaneError(reason=self.failed_round))
            return True
        release: Callable[[], None] | None = None
        try:
            data, release = take()
            before = barrier.round
            results = barrier.contribute_message(rank, message, data, release)
        except Exception as error:
            if release is not None:
                release()  # nothing of the chunk was kept: the region's loan or the frame's buffer is free
            self.refused += 1
            log.error("relay: refusing rank %d: %s: %s", rank, type(error).__name__, error)
            await send_quietly(stream, DataPlaneError(reason=str(error)[:1024]))
            return True
        if isinstance(message, ShmDeposit) and message.round >= before:
            self._down.regions.deposited(rank, message.round)  # a late chunk's round was delivered framed
        self.stragglers.watch(barrier, before, rank)
        await self.send(results)
        return False

    async def leave(self, rank: int) -> int | None:
        """Fold `rank` out; ship the chunks that completes. The round it left in, if the fold had started."""
        if self.barrier is None:
            return None
        in_round = self.barrier.round  # before the leave completes it
        await self.send(self.barrier.leave(rank))
        return in_round

    def closed_above(self, message: Broadcast, nbytes: int) -> None:
        """The controller's broadcast chunk: a round it finished that this relay still folds is over."""
        self.stragglers.closed_above(self.barrier, message, nbytes)

    async def _ship(self, result: ChunkResult[int]) -> None:
        """One completed chunk up, sealed straight from the accumulator (scatter views, no copy first);
        on the world's only host, finished and broadcast to the ranks instead.
        """
        if self.sole_host:
            await self._broadcast_here(result)
            return
        assert self.upstream is not None  # dialed before any rank is served
        await self.upstream.send(chunk_message(HostFrame, result), result.byte_views())

    async def _broadcast_here(self, result: ChunkResult[int]) -> None:
        """The sole host's completed chunk is the world's: finish it in place (what the controller would
        do) and seal it from the accumulator into every live rank's leg. A fold that cannot finish (a mean
        of total weight zero) is every rank's verdict: each gets the DataPlaneError, and later deposits too.
        """
        if self.failed_round is not None:
            return
        try:
            result.finish()
        except Exception as error:  # FoldError: the round has no value to broadcast
            self.refused += 1
            self.failed_round = f"round {result.round} cannot be finished: {error}"[:1024]
            log.error("relay: %s", self.failed_round)
            await self._down.tell_quietly(DataPlaneError(reason=self.failed_round))
            return
        await self._down.deliver(chunk_message(Broadcast, result), result.byte_views())
