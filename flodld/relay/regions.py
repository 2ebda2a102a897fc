"""Shared memory at the relay (docs/protocol.md): each rank's checked region, and the round it last
deposited there. That round's result goes back through the region (written over the rank's own, already
folded, bytes of each chunk, with a small `ShmResult`); every other round's goes framed.
"""

from __future__ import annotations

import asyncio

from flodld.net.shm import MappedRegion, ShmError, shm_mode
from flodld.net.stream import FramedStream
from flodld.wire.data import Broadcast, ShmOffer, ShmResult


class RankRegions:
    """The ranks' mapped regions (`regions`, by rank); `enabled` is False under FLODL_SHM=off."""

    def __init__(self) -> None:
        self.enabled = shm_mode() != "off"
        self.refused = 0  # offers refused (not a region this relay could map and check)
        self.regions: dict[int, MappedRegion] = {}
        self._round: dict[int, int] = {}

    @staticmethod
    def map(offer: ShmOffer, writer: asyncio.StreamWriter) -> MappedRegion:
        """Map and check the region a rank offers on its data leg (`writer`); ShmError if it is refused."""
        peer, mine = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        if not peer or not mine or len(peer) != 2:
            raise ShmError("the data leg is not an IPv4 loopback connection")
        return MappedRegion(
            offer.pid,
            offer.fd,
            offer.size,
            bytes.fromhex(offer.tag),
            leg=((str(peer[0]), int(peer[1])), (str(mine[0]), int(mine[1]))),
        )

    def keep(self, rank: int, region: MappedRegion) -> None:
        """`region` is `rank`'s from now on; the one it replaces is retired."""
        old = self.regions.pop(rank, None)
        if old is not None:
            old.retire()
        self.regions[rank] = region

    def forget(self, rank: int) -> None:
        """`rank` left: its region is unmapped now, or once the fold gave back the chunks it still holds."""
        region = self.regions.pop(rank, None)
        self._round.pop(rank, None)
        if region is not None:
            region.retire()

    def retire_all(self) -> None:
        for region in self.regions.values():
            region.retire()
        self.regions.clear()
        self._round.clear()

    def deposited(self, rank: int, round_number: int) -> None:
        """`rank` deposited (a chunk of) `round_number` in its region: that round's result goes back there."""
        self._round[rank] = round_number

    def split(
        self, legs: dict[int, FramedStream], message: Broadcast, parts: list[memoryview]
    ) -> tuple[dict[int, FramedStream], dict[int, FramedStream], ShmResult | None]:
        """Deliver a result chunk to the regions it goes back through: the legs to send it framed, the legs
        whose region has it now, and the `ShmResult` those are told (None if there are none).
        """
        length = sum(part.nbytes for part in parts)
        framed: dict[int, FramedStream] = {}
        shared: dict[int, FramedStream] = {}
        for rank, leg in legs.items():
            region = self.regions.get(rank)
            if (
                region is None
                or self._round.get(rank) != message.round
                or message.offset + length > region.capacity
            ):
                framed[rank] = leg
                continue
            region.write(message.offset, parts)
            shared[rank] = leg
        if not shared:
            return framed, shared, None
        notice = ShmResult(
            round=message.round,
            fold=message.fold,
            weight=message.weight,
            contributors=message.contributors,
            tensors=message.tensors,
            offset=message.offset,
            length=length,
        )
        return framed, shared, notice
