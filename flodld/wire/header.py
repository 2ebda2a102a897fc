"""The 24-byte cleartext header in front of every frame: its layout, the protocol version, and the
checks made on it before a single body byte is buffered (magic, version, the size caps).

Layout (little-endian, `HEADER`): magic u32, version u16, kind u16, seq u64, payload length u32, tail
length u32. The header is the AEAD's associated data, so no bit of it can be altered unnoticed; what
is checked here is only what must be refused before the body is read: a wrong magic, another protocol
version (named, with both versions), and lengths above the caps, which are the small
pre-authentication caps until the peer's first frame has verified.
"""

from __future__ import annotations

import struct
import typing
from typing import Final

from flodld.wire.aead import TAG_BYTES
from flodld.wire.errors import WireError

FRAME_MAGIC: Final = 0xF10D17C4
PROTOCOL_VERSION: Final = 2
HEADER: Final = struct.Struct("<IHHQII")
HEADER_BYTES: Final = HEADER.size  # 24
MAX_PAYLOAD: Final = 16 * 1024 * 1024
DEFAULT_MAX_TAIL: Final = 1024 * 1024 * 1024
# The first frame a side receives, before anything has proven the peer holds the key: small, no tail.
PREAUTH_MAX_PAYLOAD: Final = 16 * 1024
PREAUTH_MAX_TAIL: Final = 0


class FrameHeader(typing.NamedTuple):
    """A header that passed the checks; `raw` is its 24 bytes (the frame's associated data)."""

    kind: int
    seq: int
    payload_len: int
    tail_len: int
    raw: bytes

    @property
    def body_bytes(self) -> int:
        """What follows the header on the wire: the encrypted payload ‖ tail and the tag."""
        return self.payload_len + self.tail_len + TAG_BYTES


def parse_header(raw: bytes, *, max_payload: int, max_tail: int, preauth: bool) -> FrameHeader:
    """The header in `raw` (HEADER_BYTES long) held to these caps; WireError (bad_magic, bad_version,
    too_large) names what was refused. `preauth`: the caps are the first frame's, and the message says so.
    """
    magic, version, kind, seq, payload_len, tail_len = HEADER.unpack(raw)
    fits = payload_len <= max_payload and tail_len <= max_tail
    if magic == FRAME_MAGIC and version == PROTOCOL_VERSION and fits:
        return FrameHeader(kind, seq, payload_len, tail_len, raw)
    if magic != FRAME_MAGIC:
        raise WireError("bad_magic", f"frame magic {magic:#010x} != {FRAME_MAGIC:#010x}")
    if version != PROTOCOL_VERSION:
        raise WireError(
            "bad_version",
            f"the peer speaks flodld wire protocol version {version}, this build speaks version "
            f"{PROTOCOL_VERSION}; run the same flodld release on both ends"
            + (" (version 1 frames are cleartext; version 2 encrypts every frame)" if version == 1 else ""),
        )
    what = "first frame's (pre-authentication) " if preauth else ""
    if payload_len > max_payload:
        refused = f"{what}payload of {payload_len} bytes exceeds the cap of {max_payload}"
    else:
        refused = f"{what}tail of {tail_len} bytes exceeds the cap of {max_tail}"
    raise WireError("too_large", f"{refused}; refused unread")
