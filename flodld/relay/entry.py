"""Ranks entering a relay's averaging during training (docs/elastic-averaging.md, "Growth and healing" and
"Slots heal in place").

A walk-in's relay: each rank says when it waits to enter (RankReady, at its first averaging call); the
controller's Entry comes once every one has. Its ranks enter at the round the Entry names, and get the
state that follows it (the last averaged result, round `entry.round - 1`, in Broadcast chunks) before their
first deposit. The relay keeps that state until every local rank has it.

A rider: a healed slot's rank that rides a relay already in the averaging (Hello.rides). The controller
says it comes (RankExpected); it dials, says RankReady, and the controller's Entry naming it (`Entry.ranks`)
comes at the end of a round, before that round's last result chunk, with the state. The relay admits it to
its fold at the Entry's round (its other ranks cannot have deposited for it yet: they wait for that last
chunk) and hands it the Entry and the state. Until then it gets no round's result (`first_round`: the
Delivery holds a rider's results back until the round it entered at).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

from flodld.net.stream import FramedStream
from flodld.wire.data import Broadcast, Entry
from flodld.wire.errors import WireError

if TYPE_CHECKING:
    from flodld.fold.barrier import RoundBarrier

NOT_ENTERED = 1 << 62
"""A waiting rider's first round: no round's result reaches it before its Entry."""


class _Handover:
    """One Entry and the state chunks that follow it, kept (copied) until the ranks it names have them."""

    def __init__(self, entry: Entry, ranks: set[int]) -> None:
        self.entry = entry
        self.ranks = ranks
        self.complete = not entry.state  # the state is whole (or there is none): the ranks may have it
        self.chunks: list[tuple[Broadcast, bytes]] = []
        self.bytes = 0
        self.handed: set[int] = set()

    def take(self, message: Broadcast, view: memoryview) -> str | None:
        total = sum(spec.nbytes() for spec in message.tensors)
        if (
            message.round != self.entry.round - 1
            or message.offset != self.bytes
            or message.offset + view.nbytes > total
        ):
            return (
                f"controller sent a state chunk out of turn (round {message.round}, offset {message.offset})"
            )
        self.chunks.append((message, bytes(view)))
        self.bytes += view.nbytes
        self.complete = self.bytes == total
        return None


class WalkInEntry:
    """The walk-in's own Entry and state, and the riders', and which ranks were handed them.

    `ranks` are the relay's; `gone` is the relay's set of ranks that left (read as it grows).
    """

    def __init__(self, walk_in: bool, ranks: Collection[int], gone: set[int]) -> None:
        self.walk_in = walk_in
        self.entry: Entry | None = None  # the walk-in host's own
        self._ranks = set(ranks)
        self._gone = gone
        self._own: _Handover | None = None
        self._ride: _Handover | None = None  # the riders' Entry whose state is being taken or handed
        self._ready: set[int] = set()  # ranks that said RankReady
        self.expected: set[int] = set()  # riders told of (RankExpected) that have not entered
        self.first_round: dict[int, int] = {}  # a rider's first round with a result for it (the Delivery's)

    @property
    def complete(self) -> bool:
        """The walk-in's own state is whole (or there is none)."""
        return self._own is not None and self._own.complete

    @property
    def taking_state(self) -> bool:
        """Whether the controller's Broadcasts are still an Entry's state, not rounds to deliver."""
        return (self.walk_in and not self.complete) or (self._ride is not None and not self._ride.complete)

    def expect(self, rank: int) -> str | None:
        """A rider will dial (RankExpected); why the relay cannot take it, or None."""
        if rank in self._ranks or rank in self._gone:
            return f"controller expected rank {rank}, which this relay has served already"
        self._ranks.add(rank)
        self.expected.add(rank)
        self.first_round[rank] = NOT_ENTERED
        return None

    def ready(self, rank: int) -> str | None:
        """`rank` says it waits to enter (RankReady); why that is out of turn, or None (said once each)."""
        if rank in self.expected:
            return self._ready_once(rank)
        if not self.walk_in:
            return "to a relay that did not walk in"
        if self.entry is not None:
            return "after its host entered"
        return self._ready_once(rank)

    def _ready_once(self, rank: int) -> str | None:
        if rank in self._ready:
            return "twice"
        self._ready.add(rank)
        return None

    def enter(self, message: Entry, barrier: RoundBarrier[int] | None) -> str | None:
        """The controller's Entry for the walk-in's own ranks (the relay's barrier, if it has one, begins at
        its round); why the relay cannot take it, or None.
        """
        if not self.walk_in or self.entry is not None:
            why = "an Entry to a relay that did not walk in" if not self.walk_in else "a second Entry"
            return f"controller sent {why}"
        self.entry = message
        self._own = _Handover(message, set(self._ranks))
        if barrier is not None:
            try:
                barrier.begin_at(message.round)
            except ValueError as error:  # a rank deposited before its entry: the relay is out of step
                return f"cannot enter at round {message.round}: {error}"
        return None

    def enter_riders(self, message: Entry, barrier: RoundBarrier[int] | None) -> dict[int, str]:
        """The controller's Entry naming riders: each admitted to `barrier` at its round, unless the fold is
        not at that boundary (or the rank never said it was ready). Returns the riders refused, with why;
        a rider gone meanwhile is neither. The state that follows is taken either way (`take`).
        """
        refused: dict[int, str] = {}
        admitted: set[int] = set()
        at = None if barrier is None else (barrier.round, barrier.started)
        for rank in sorted(set(message.ranks)):
            if rank in self._gone:
                continue
            if rank not in self.expected or rank not in self._ready:
                refused[rank] = f"controller let rank {rank} in before it was a rider ready to enter"
            elif at is None or at != (message.round, False):
                where = "has not folded a round" if at is None else f"is at round {at[0]}"
                started = " (started)" if at is not None and at[1] else ""
                refused[rank] = f"cannot enter at round {message.round}: this relay's fold {where}{started}"
            else:
                admitted.add(rank)
        for rank in admitted:
            assert barrier is not None
            barrier.admit(rank)
            self.expected.discard(rank)
            self.first_round[rank] = message.round
        self._ride = _Handover(message, admitted)
        return refused

    def take(self, message: Broadcast, view: memoryview) -> str | None:
        """A chunk of the state the Entry being served announced, kept (copied); why it is out of turn, or
        None.
        """
        handover = self._ride if self._ride is not None and not self._ride.complete else self._own
        if handover is None or handover.complete:
            where = f"round {message.round}, offset {message.offset}"
            return f"controller sent a state chunk out of turn ({where})"
        return handover.take(message, view)

    @property
    def state_bytes(self) -> int:
        handover = self._ride if self._ride is not None else self._own
        return handover.bytes if handover is not None else 0

    async def hand(self, legs: dict[int, FramedStream], lost: Callable[[int], Awaitable[None]]) -> None:
        """Each complete Entry and its state to the ranks of `legs` it names and that were not handed it yet
        (`lost`: a rank whose leg failed); a kept copy goes once every rank it names has it (or is gone).
        """
        for handover in (self._own, self._ride):
            if handover is not None and handover.complete:
                await self._hand(handover, legs, lost)
        if self._ride is not None and self._ride.complete and not self._ride.chunks:
            self._ride = None  # handed: the next riders' Entry starts afresh

    async def _hand(
        self, handover: _Handover, legs: dict[int, FramedStream], lost: Callable[[int], Awaitable[None]]
    ) -> None:
        owed = handover.ranks - handover.handed
        todo = {rank: leg for rank, leg in legs.items() if rank in owed}
        handover.handed.update(todo)

        async def one(rank: int, leg: FramedStream) -> None:
            try:
                await leg.send(handover.entry)
                for chunk, data in handover.chunks:
                    await leg.send(chunk, data)
            except (OSError, WireError):
                await lost(rank)

        await asyncio.gather(*(one(rank, leg) for rank, leg in todo.items()))
        if handover.handed | self._gone >= handover.ranks:
            handover.chunks = []  # every rank has it: the copy is not needed any more
