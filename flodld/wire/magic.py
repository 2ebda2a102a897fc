"""Channel magics: the first 4 bytes of every connection to the controller's single port.

The magic routes a connection to its subsystem. It is not authenticated by itself, but both ends
bind it into the connection's keys (`flodld.wire.aead.direction_keys`): a spoofed magic only
lands the bytes at a handler whose frame authentication rejects them, and frames keyed for one
channel never verify on another.
"""

from __future__ import annotations

import struct
from enum import StrEnum
from typing import Final


class Channel(StrEnum):
    RENDEZVOUS = "rendezvous"
    DATA = "data"
    CONTROL = "control"
    JOIN = "join"
    HTTP = "http"


CHANNEL_MAGICS: Final[dict[Channel, int]] = {
    Channel.RENDEZVOUS: 0xF10D17E0,
    Channel.DATA: 0xF10D17E1,
    Channel.CONTROL: 0xF10D17E2,
    Channel.JOIN: 0xF10D17E3,
}

# HTTP needs no magic of its own: these request-line starts are the prefix, and they stay part of
# the request the HTTP handler parses.
HTTP_PREFIXES: Final[tuple[bytes, ...]] = (b"GET ", b"POST", b"HEAD")

MAGIC_BYTES: Final = 4
_U32_LE: Final = struct.Struct("<I")
_CHANNEL_BY_MAGIC: Final[dict[int, Channel]] = {value: channel for channel, value in CHANNEL_MAGICS.items()}


def channel_for_prefix(prefix: bytes) -> Channel | None:
    """The channel the 4-byte prefix announces, or None for an unknown magic."""
    if len(prefix) != MAGIC_BYTES:
        raise ValueError(f"a channel prefix is exactly {MAGIC_BYTES} bytes, got {len(prefix)}")
    if prefix in HTTP_PREFIXES:
        return Channel.HTTP
    (value,) = _U32_LE.unpack(prefix)
    return _CHANNEL_BY_MAGIC.get(value)


def magic_prefix(channel: Channel) -> bytes:
    """The 4 bytes a dialer writes first to reach `channel`."""
    if channel is Channel.HTTP:
        raise ValueError("the HTTP channel has no magic; HTTP clients just send their request line")
    return _U32_LE.pack(CHANNEL_MAGICS[channel])
