"""The bytes of a frame, checked against an independent AEAD: what a peer of another build must see.

The per-frame path is tuned for speed (one struct for the AEAD nonce, a named tuple for the header,
payloads serialized straight to bytes); these checks pin the wire format it must keep producing.
"""

from __future__ import annotations

import struct
import sys

import pydantic
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from flodld.wire import aead as wire_aead
from flodld.wire import frames as wf
from flodld.wire import store as ws
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt
from tests.flodld.membership.helpers import hello


def _pair(aes: bool) -> tuple[wf.FrameConnection, wf.FrameConnection, bytes]:
    key = new_salt()
    dialer = wf.FrameConnection(wf.Role.DIALER, key, channel=Channel.RENDEZVOUS, aes=aes)
    listener = wf.FrameConnection(wf.Role.LISTENER, key, channel=Channel.RENDEZVOUS, aes=aes)
    dialer.receive_data(listener.initial_bytes())
    listener.receive_data(dialer.initial_bytes())
    dialer.next_event()
    listener.next_event()
    return dialer, listener, key


@pytest.mark.parametrize("aes", [True, False], ids=["aes-gcm", "chacha20-poly1305"])
@pytest.mark.parametrize("role", [wf.Role.DIALER, wf.Role.LISTENER])
def test_each_frame_is_the_header_then_the_aead_of_payload_and_tail_under_the_direction_nonce(
    aes: bool, role: wf.Role
) -> None:
    dialer, listener, key = _pair(aes)
    sender = dialer if role is wf.Role.DIALER else listener
    suite = wire_aead.choose_suite(dialer.nonce, listener.nonce)
    assert suite is (wf.Suite.AES_256_GCM if aes else wf.Suite.CHACHA20_POLY1305)
    sender_key, _ = wire_aead.direction_keys(
        key, dialer.nonce, listener.nonce, Channel.RENDEZVOUS, suite, role
    )
    aead = AESGCM(sender_key) if aes else ChaCha20Poly1305(sender_key)
    direction = b"D" if role is wf.Role.DIALER else b"L"
    tails: list[bytes | bytearray | memoryview] = [
        b"",
        b"value" * 10,
        bytearray(b"\x00\x01" * 40),
        memoryview(b"xyz"),
    ]
    for seq, tail in enumerate(tails):
        request = ws.StoreSet(key=f"/pg/rank/{seq}", request_id=seq + 1)
        wire = bytes(sender.send_message(request, tail))
        payload = request.model_dump_json().encode()
        header = wire[:wf.HEADER_BYTES]
        assert wf.HEADER.unpack(header) == (
            wf.FRAME_MAGIC,
            wf.PROTOCOL_VERSION,
            ws.StoreSet.KIND,
            seq,
            len(payload),
            len(bytes(tail)),
        )
        nonce = direction + b"\x00\x00\x00" + struct.pack("<Q", seq)
        plain = aead.decrypt(nonce, wire[wf.HEADER_BYTES:], header)
        assert plain == payload + bytes(tail)
        assert len(wire) == wf.HEADER_BYTES + len(plain) + wf.TAG_BYTES


def test_frames_read_ahead_in_one_feed_come_out_one_by_one_in_order() -> None:
    dialer, listener, _ = _pair(True)
    wire = b"".join(bytes(dialer.send_message(ws.StoreGet(key=f"k{i}", timeout=1.0))) for i in range(5))
    listener.receive_data(wire)  # five frames in one read, as a read-ahead at a frame boundary gets them
    keys = []
    for _ in range(5):
        assert listener.at_boundary
        frame = listener.next_event()
        assert isinstance(frame, wf.Frame)
        message = frame.message()
        assert isinstance(message, ws.StoreGet)
        keys.append(message.key)
    assert keys == [f"k{i}" for i in range(5)]


def test_names_refuse_every_whitespace_character_as_before() -> None:
    """`HostName` refuses any whitespace: the fast test (printable, no U+0020) equals the per-char one."""
    whitespace = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert len(whitespace) > 20  # tab, newline, NBSP, the ideographic space, ...
    for char in whitespace:
        with pytest.raises(pydantic.ValidationError):
            hello(f"host{char}a")
