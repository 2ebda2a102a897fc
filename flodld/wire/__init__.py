"""Sans-io wire layer: channel magics, session salts, authenticated frames and pydantic messages.

Importing the package registers every channel's messages, so `Frame.message()` can decode any kind
whichever module a shell imported first.
"""

from __future__ import annotations

from flodld.wire import control, data, join, store
from flodld.wire.errors import WireError
from flodld.wire.frames import CLOSED, NEED_DATA, Closed, Frame, FrameConnection, NeedData, Role
from flodld.wire.magic import Channel, channel_for_prefix, magic_prefix
from flodld.wire.messages import Message, decode_message, encode_message, register

__all__ = [
    "CLOSED",
    "NEED_DATA",
    "Channel",
    "Closed",
    "Frame",
    "FrameConnection",
    "Message",
    "NeedData",
    "Role",
    "WireError",
    "channel_for_prefix",
    "control",
    "data",
    "decode_message",
    "encode_message",
    "join",
    "magic_prefix",
    "register",
    "store",
]
