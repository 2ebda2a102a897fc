"""Data-plane messages (kinds 0x03xx): rank ⇄ relay loopback legs and relay ⇄ controller DATA channel.

Tensors travel in the frame's tail as raw little-endian bytes, described in the payload by
`TensorSpec`s; `flodld.fold.codec` converts. The payload carries the fold spec so every hop can
rebuild the same reduction without configuration (a modular fold carries its moduli).

Flow of one round: each rank sends `Deposit` to its relay; the relay sends one `HostFrame` (the
partial sum of its live ranks) upstream; the controller folds hosts and sends `Broadcast` (the
finished value) to every relay, which forwards it to its live ranks. In a world of one host the
controller's HelloAck says `sole_host` and that relay broadcasts its own fold (no HostFrame goes up).

Chunks: a large bundle travels as several frames of one kind, each carrying the whole schema (`tensors`)
and, in its tail, the bytes [`offset`, `offset` + tail length) of the bundle's bytes (every tensor's
bytes, concatenated in order), starting and ending on element boundaries. Every hop folds and forwards
a chunk as soon as every live member's chunk at that offset is in. An unchunked frame is the chunk at
offset 0 that carries every byte. `flodld.fold.chunks` splits and checks (docs/protocol.md).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from flodld.wire.messages import (
    BoundedList,
    Count,
    HexDigest,
    HostName,
    Message,
    Rank,
    Reason,
    ShortText,
    WireModel,
    register,
)

MAX_TENSOR_DIMS: Final = 8
MAX_TENSORS_PER_FRAME: Final = 4096

TensorDtype = Literal["float32", "float64", "float16", "bfloat16", "int64", "int32"]
DTYPE_BYTES: Final[dict[str, int]] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
}

Dimension = Annotated[int, Field(ge=0, lt=2**40)]


class TensorSpec(WireModel):
    """dtype and shape of one tensor in the tail; its byte length follows from them."""

    dtype: TensorDtype
    shape: Annotated[list[Dimension], Field(max_length=MAX_TENSOR_DIMS)]

    def nbytes(self) -> int:
        count = 1
        for dimension in self.shape:
            count *= dimension
        return count * DTYPE_BYTES[self.dtype]


TensorSpecs = Annotated[list[TensorSpec], Field(max_length=MAX_TENSORS_PER_FRAME)]
FoldSpec = ShortText
Weight = Annotated[float, Field(ge=0)]


@register(0x0301)
class RelayHello(Message):
    """Relay → controller, first frame on the DATA and on the CONTROL channel: who this relay speaks for.

    `proof` is `flodld.wire.hostkey.relay_proof` under the host key derived at the host's admission;
    after HelloAck both sides rekey the connection to that host key.
    """

    host: HostName
    ranks: BoundedList[Rank]
    proof: HexDigest


@register(0x0302)
class HelloAck(Message):
    """Answer to RelayHello or RankHello: the listener accepted the identity.

    `sole_host` (controller → relay, DATA channel): this relay's host is the world's only host, so the
    relay finishes every chunk and broadcasts it to its ranks itself; no data frame goes to the controller.
    """

    sole_host: bool = False


@register(0x0303)
class RankHello(Message):
    """Rank → relay, first frame on each loopback leg."""

    rank: Rank


@register(0x0304)
class Deposit(Message):
    """Rank → relay: this rank's weighted contribution to `round` (tail: tensors)."""

    round: Count
    fold: FoldSpec
    weight: Weight
    tensors: TensorSpecs
    offset: Count = 0


class _FoldedChunk(Message):
    """A chunk of a fold of several ranks' deposits: what HostFrame and Broadcast carry (tail: tensors)."""

    round: Count
    fold: FoldSpec
    weight: Weight
    contributors: BoundedList[Rank]
    tensors: TensorSpecs
    offset: Count = 0


@register(0x0305)
class HostFrame(_FoldedChunk):
    """Relay → controller: the partial fold of this host's live ranks for `round` (tail: tensors)."""


@register(0x0306)
class Broadcast(_FoldedChunk):
    """Controller → relay → rank: the finished value of `round` (tail: tensors)."""


@register(0x0307)
class RankGone(Message):
    """Relay → controller: a local rank closed its leg; fold it out of every later round. `round`: the relay's
    round in progress when it left (the round it was lost in; None before the relay folded any).
    """

    rank: Rank
    reason: Reason = ""
    round: Annotated[int, Field(ge=0)] | None = None


@register(0x0308)
class DataPlaneError(Message):
    """Either direction, just before closing: why this hop refuses to go on (double deposit, schema)."""

    reason: Reason


@register(0x030E)
class Entry(Message):
    """Controller → a walk-in's relay → its ranks (docs/elastic-averaging.md, "Growth and healing"): the
    host's ranks enter the averaging at `round` (their first deposit's round). With `state`, the Broadcast
    chunks of round `round - 1` follow at once: the last averaged result, the bytes every member holds,
    for the ranks to start from. `members` and `epoch`: the membership the ranks start with (the members
    expected in `round`, the walk-ins among them).
    """

    round: Count
    epoch: Count
    members: BoundedList[Rank]
    state: bool = False
    # The ranks that enter: empty, every rank of the walk-in's host; else ranks that ride a relay already in
    # the averaging (RankExpected), which enter alone while its other ranks go on.
    ranks: BoundedList[Rank] = Field(default_factory=list)


@register(0x0311)
class RankExpected(Message):
    """Controller → a relay in the averaging (docs/elastic-averaging.md, "Slots heal in place"): `rank`, a
    healed slot's rank that rides this relay (Hello.rides), will dial it. The relay serves its legs from now
    on, and it enters like a walk-in's rank: RankReady, RankConnected, then an Entry naming it.
    """

    rank: Rank


@register(0x030F)
class RankConnected(Message):
    """A walk-in's relay → controller, before its Entry (docs/elastic-averaging.md, "Growth and healing"):
    `rank` of this host is ready to enter (it sent RankReady, and the relay can fold). The controller lets
    the host in at a round boundary only once every rank of it is (or has gone), so the members never wait
    in a round for a walk-in's start-up.
    """

    rank: Rank


@register(0x0310)
class RankReady(Message):
    """A walk-in's rank → its relay, on its data leg, once, before its Entry: the rank now waits to enter
    (its first averaging call, `walk_in_state()` or `membership()`), its shared-memory region offered
    already. Its start-up (imports, the script's set-up, a first training step) is over, so the round
    it enters at waits for nothing but its deposit. No fields: the leg names the rank.
    """


# --- shared memory between a rank and its relay (same host; docs/protocol.md, "Shared memory") ---------

MAX_REGION_BYTES: Final = 1 << 38  # 256 GiB: refused before anything is opened or mapped
Pid = Annotated[int, Field(ge=1, lt=2**31)]
Fd = Annotated[int, Field(ge=0, lt=2**31)]
RegionBytes = Annotated[int, Field(gt=64, le=MAX_REGION_BYTES)]
RegionTag = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]


@register(0x0309)
class ShmOffer(Message):
    """Rank → relay on its data leg: map my region, memory file `fd` of process `pid`, `size` bytes, whose
    head holds `tag` (hex). A later offer replaces the earlier one (a bigger bundle). The relay answers
    `ShmAccepted` or `ShmRefused`; only this leg's authenticated rank may use the region.
    """

    pid: Pid
    fd: Fd
    size: RegionBytes
    tag: RegionTag


@register(0x030A)
class ShmAccepted(Message):
    """Relay → rank: the offered region is mapped and checked; `ShmDeposit` may name it."""

    size: RegionBytes


@register(0x030B)
class ShmRefused(Message):
    """Relay → rank: the offer is refused (the reason); the rank goes on framed, the leg stays open."""

    reason: Reason


@register(0x030C)
class ShmDeposit(Message):
    """Rank → relay: a `Deposit` chunk whose bytes lie in the rank's region at bundle bytes
    [`offset`, `offset` + `length`) (no tail).
    """

    round: Count
    fold: FoldSpec
    weight: Weight
    tensors: TensorSpecs
    offset: Count = 0
    length: Count = 0


@register(0x030D)
class ShmResult(_FoldedChunk):
    """Relay → rank: a `Broadcast` chunk the relay wrote into the rank's region over its deposit, bytes
    [`offset`, `offset` + `length`) (no tail). Sent only for a round the rank deposited in its region.
    """

    length: Count = 0
