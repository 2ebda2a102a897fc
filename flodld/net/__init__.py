"""Socket adapters around flodld.wire: the only place flodld turns frames into I/O."""

from __future__ import annotations

from flodld.net.blocking import BlockingChannel
from flodld.net.stream import (
    ConnectError,
    FramedStream,
    accept_channel,
    connect_with_retry,
    open_channel,
    read_channel_prefix,
)
from flodld.net.timeouts import TimeoutScaleError, scaled, timeout_scale

__all__ = [
    "BlockingChannel",
    "ConnectError",
    "FramedStream",
    "TimeoutScaleError",
    "accept_channel",
    "connect_with_retry",
    "open_channel",
    "read_channel_prefix",
    "scaled",
    "timeout_scale",
]
