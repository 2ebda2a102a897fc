"""Issue 21: a peer still speaking wire protocol version 1 (HMAC-authenticated cleartext) is refused, over
real sockets, with both versions named: by a listener (the controller's join channel) and by a dialer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging

import pytest

from flodld.net.stream import open_channel
from flodld.wire.errors import WireError
from flodld.wire.frames import FRAME_MAGIC, HEADER, PROTOCOL_VERSION
from flodld.wire.join import Reject
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import encode_message
from tests.flodld.net.conftest import loopback_server
from tests.reliability.daemon import hello, running

V1_LABEL = b"flodld/session/v2"  # version 1's session-key label (it named the key derivation, not the frame)


def v1_frame(salt: bytes, channel: Channel, dialer_nonce: bytes, listener_nonce: bytes, direction: bytes,
             kind: int, payload: bytes) -> bytes:
    """A frame exactly as a version-1 build writes it: cleartext payload, truncated HMAC-SHA256 tag."""
    key = hmac.digest(salt, V1_LABEL + magic_prefix(channel) + dialer_nonce + listener_nonce, hashlib.sha256)
    header = HEADER.pack(FRAME_MAGIC, 1, kind, 0, len(payload), 0)
    return header + payload + hmac.digest(key, direction + header + payload, hashlib.sha256)[:16]


async def test_the_controller_refuses_a_version_1_agent_naming_both_versions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with running() as (controller, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        dialer_nonce = bytes(range(16))
        writer.write(magic_prefix(Channel.JOIN) + dialer_nonce)
        listener_nonce = await asyncio.wait_for(reader.readexactly(16), 5)
        kind, payload = encode_message(hello("old-agent"))
        writer.write(
            v1_frame(controller.salt, Channel.JOIN, dialer_nonce, listener_nonce, b"D", kind, payload)
        )
        async with asyncio.timeout(5):
            assert await reader.read(-1) == b""  # dropped unanswered
        writer.close()
    refusals = [r.getMessage() for r in caplog.records if "bad_version" in r.getMessage()]
    assert refusals, [r.getMessage() for r in caplog.records]
    assert "version 1" in refusals[0] and f"version {PROTOCOL_VERSION}" in refusals[0]


async def test_a_dialer_refuses_a_version_1_listener_naming_both_versions() -> None:
    salt = bytes(range(16))

    async def old_listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        dialer_nonce = await reader.readexactly(16)
        listener_nonce = bytes(16)
        kind, payload = encode_message(Reject(code="busy", reason="a version 1 controller"))
        writer.write(
            listener_nonce + v1_frame(salt, Channel.JOIN, dialer_nonce, listener_nonce, b"L", kind, payload)
        )
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    async with loopback_server(old_listener) as port:
        stream = await open_channel("127.0.0.1", port, Channel.JOIN, salt, timeout=5)
        with pytest.raises(WireError) as caught:
            await stream.recv(5)
        stream.close()
    assert caught.value.code == "bad_version"
    assert "version 1" in str(caught.value) and f"version {PROTOCOL_VERSION}" in str(caught.value)
