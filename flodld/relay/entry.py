"""A walk-in relay's entry (docs/elastic-averaging.md, "Growth and healing").

Each rank says when it waits to enter (RankReady, at its first averaging call); the controller's Entry
comes once every one has. Its ranks enter at the round the Entry names, and get the state that follows it
(the last averaged result, round `entry.round - 1`, in Broadcast chunks) before their first deposit. The
relay keeps that state until every local rank has it.
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


class WalkInEntry:
    """The Entry and the state chunks, kept in order, and which ranks were handed them.

    `ranks` are the relay's; `gone` is the relay's set of ranks that left (read as it grows).
    """

    def __init__(self, walk_in: bool, ranks: Collection[int], gone: set[int]) -> None:
        self.walk_in = walk_in
        self.entry: Entry | None = None
        self.complete = False  # the state is whole (or there is none): ranks may have it
        self._ranks = set(ranks)
        self._gone = gone
        self._chunks: list[tuple[Broadcast, bytes]] = []
        self._bytes = 0
        self._handed: set[int] = set()
        self._ready: set[int] = set()  # ranks that said RankReady

    @property
    def taking_state(self) -> bool:
        """Whether the controller's Broadcasts are still this walk-in's state, not rounds to deliver."""
        return self.walk_in and not self.complete

    def ready(self, rank: int) -> str | None:
        """`rank` says it waits to enter (RankReady); why that is out of turn, or None (said once each)."""
        if not self.walk_in:
            return "to a relay that did not walk in"
        if self.entry is not None:
            return "after its host entered"
        if rank in self._ready:
            return "twice"
        self._ready.add(rank)
        return None

    def enter(self, message: Entry, barrier: RoundBarrier[int] | None) -> str | None:
        """The controller's Entry (the relay's barrier, if it has one, begins at its round); why the relay
        cannot take it, or None.
        """
        if not self.walk_in or self.entry is not None:
            why = "an Entry to a relay that did not walk in" if not self.walk_in else "a second Entry"
            return f"controller sent {why}"
        self.entry = message
        if barrier is not None:
            try:
                barrier.begin_at(message.round)
            except ValueError as error:  # a rank deposited before its entry: the relay is out of step
                return f"cannot enter at round {message.round}: {error}"
        self.complete = not message.state
        return None

    def take(self, message: Broadcast, view: memoryview) -> str | None:
        """A chunk of the state, kept (copied); why it is out of turn, or None."""
        entry = self.entry
        total = sum(spec.nbytes() for spec in message.tensors)
        if (
            entry is None
            or message.round != entry.round - 1
            or message.offset != self._bytes
            or message.offset + view.nbytes > total
        ):
            return (
                f"controller sent a state chunk out of turn (round {message.round}, offset {message.offset})"
            )
        self._chunks.append((message, bytes(view)))
        self._bytes += view.nbytes
        self.complete = self._bytes == total
        return None

    @property
    def state_bytes(self) -> int:
        return self._bytes

    async def hand(self, legs: dict[int, FramedStream], lost: Callable[[int], Awaitable[None]]) -> None:
        """Entry and the state to each of `legs` not handed them yet (`lost`: a rank whose leg failed); the
        kept copy goes once every local rank has it (or is gone).
        """
        entry = self.entry
        if entry is None:
            return
        todo = {rank: leg for rank, leg in legs.items() if rank not in self._handed}
        self._handed.update(todo)

        async def one(rank: int, leg: FramedStream) -> None:
            try:
                await leg.send(entry)
                for chunk, data in self._chunks:
                    await leg.send(chunk, data)
            except (OSError, WireError):
                await lost(rank)

        chunks = self._chunks
        await asyncio.gather(*(one(rank, leg) for rank, leg in todo.items()))
        if self._handed | self._gone >= self._ranks and self._chunks is chunks:
            self._chunks = []  # every rank has it: the copy is not needed any more
