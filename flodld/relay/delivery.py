"""What goes down the ranks' legs: control words and result chunks fanned out to every live rank, a result
chunk through the shared-memory region of each rank that deposited its round there (`RankRegions.split`)
and framed to the others. A leg that cannot take its frame is the relay's to fold out (`lost`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from flodld.net.stream import FramedStream
from flodld.relay.regions import RankRegions
from flodld.wire.data import Broadcast
from flodld.wire.errors import WireError
from flodld.wire.frames import HEADER_BYTES, TAG_BYTES, Tail
from flodld.wire.magic import Channel
from flodld.wire.messages import Message, encode_message


async def send_quietly(stream: FramedStream, message: Message) -> None:
    """A last word to a leg that may be gone already (a refusal): its failure is not news."""
    try:
        await stream.send(message)
    except (OSError, WireError):
        pass


class Delivery:
    """Sends to the live legs in `legs` (by channel, then rank: the relay's, read as it changes)."""

    def __init__(
        self,
        legs: dict[Channel, dict[int, FramedStream]],
        regions: RankRegions,
        lost: Callable[[int, Channel], Awaitable[None]],
    ) -> None:
        self.legs = legs
        self.regions = regions
        self._lost = lost
        self.rounds = 0  # rounds whose result went down (counted at their first chunk)
        # A rider's first round with a result for it (flodld.relay.entry): none before it entered.
        self.first_round: dict[int, int] = {}

    async def fan_out(self, channel: Channel, message: Message, tail: Tail) -> None:
        """`message` to every live leg of `channel`."""
        await self._fan_out_to(channel, dict(self.legs[channel]), message, tail)

    async def tell_quietly(self, message: Message) -> None:
        """`message` to every live data leg, a failure to send it ignored."""
        await asyncio.gather(*(send_quietly(leg, message) for leg in list(self.legs[Channel.DATA].values())))

    async def deliver(self, message: Broadcast, parts: list[memoryview]) -> None:
        """A result chunk to every live rank: written into the region of each rank that deposited this
        round there (over its own, already folded, bytes of this chunk) with a small `ShmResult`; framed
        to the others.
        """
        if message.offset == 0:
            self.rounds += 1
        legs = dict(self.legs[Channel.DATA])
        if self.first_round:
            legs = {rank: leg for rank, leg in legs.items() if self.first_round.get(rank, 0) <= message.round}
            if message.offset == 0:  # riders in by this round are ranks like the others from now on
                for rank in [rank for rank, first in self.first_round.items() if first <= message.round]:
                    del self.first_round[rank]
        framed, shared, notice = self.regions.split(legs, message, parts)
        sends = [self._fan_out_to(Channel.DATA, framed, message, parts)] if framed else []
        if notice is not None:
            sends.append(self._fan_out_to(Channel.DATA, shared, notice, b""))
        # The framed and the shared-memory legs concurrently; either alone with no task to wrap it.
        await (sends[0] if len(sends) == 1 else asyncio.gather(*sends))

    async def _fan_out_to(
        self, channel: Channel, legs: dict[int, FramedStream], message: Message, tail: Tail
    ) -> None:
        kind, payload = encode_message(message)  # once, for every leg

        async def one(rank: int, leg: FramedStream) -> None:
            try:
                await leg.send_frame(kind, payload, tail)
            except (OSError, WireError):
                await self._lost(rank, channel)

        # Concurrently: the next leg's frame is sealed while the previous one drains into its rank. A leg
        # that takes the frame at once (nothing in flight there, the frame within its transport's high-water
        # mark: the send never waits) is sent it in turn, first, with no task; a leg it fails on is folded
        # out with the others.
        nbytes = HEADER_BYTES + len(payload) + _nbytes(tail) + TAG_BYTES
        waiting: list[Awaitable[None]] = []
        for rank, leg in legs.items():
            if not leg.takes_at_once(nbytes):
                waiting.append(one(rank, leg))
                continue
            try:
                await leg.send_frame(kind, payload, tail)
            except (OSError, WireError):
                waiting.append(self._lost(rank, channel))
        if waiting:
            await asyncio.gather(*waiting)


def _nbytes(tail: Tail) -> int:
    if isinstance(tail, bytes | bytearray):
        return len(tail)
    if isinstance(tail, memoryview):
        return tail.nbytes
    return sum(memoryview(part).nbytes for part in tail)
