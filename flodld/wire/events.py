"""What a `FrameConnection` hands out (h11's events): a verified `Frame`, or the `NEED_DATA` and
`CLOSED` sentinels; and the buffer types a frame's tail may come in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from flodld.wire.messages import Message, decode_message

BytesLike = bytes | bytearray | memoryview
Tail = BytesLike | Sequence[BytesLike]
"""A frame's tail: one contiguous buffer, or a list of them (scatter parts, sealed into the frame in turn)."""


class Frame:
    """One decrypted, authenticated frame, in order.

    `tail_view` is the tail without a copy (a view into the buffer the frame was decrypted in, which
    nothing else uses); `tail` is the same bytes as a `bytes` object (copied once, on first use).
    """

    __slots__ = ("_tail_bytes", "body", "kind", "payload", "seq", "tail_view")

    def __init__(self, kind: int, seq: int, payload: bytes, tail: BytesLike = b"") -> None:
        self.kind = kind
        self.seq = seq
        self.payload = payload
        self.tail_view = memoryview(tail).cast("B") if not isinstance(tail, bytes) else memoryview(tail)
        self._tail_bytes: bytes | None = tail if isinstance(tail, bytes) else None
        self.body: memoryview | None = None  # the large buffer the frame was decrypted in, for `recycle`

    @property
    def tail(self) -> bytes:
        if self._tail_bytes is None:
            self._tail_bytes = bytes(self.tail_view)
        return self._tail_bytes

    def message(self) -> Message:
        """The payload decoded as the message registered for `kind` (WireError on failure)."""
        return decode_message(self.kind, self.payload)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return (self.kind, self.seq, self.payload) == (other.kind, other.seq, other.payload) and (
            self.tail_view == other.tail_view
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value object, like a dataclass with eq

    def __repr__(self) -> str:
        sizes = f"payload={len(self.payload)}B, tail={self.tail_view.nbytes}B"
        return f"Frame(kind={self.kind:#06x}, seq={self.seq}, {sizes})"


class NeedData:
    """Sentinel type: feed more bytes with `receive_data` (see `bytes_wanted`)."""

    def __repr__(self) -> str:
        return "NEED_DATA"


class Closed:
    """Sentinel type: the peer closed the connection cleanly, on a frame boundary."""

    def __repr__(self) -> str:
        return "CLOSED"


NEED_DATA: Final = NeedData()
CLOSED: Final = Closed()
