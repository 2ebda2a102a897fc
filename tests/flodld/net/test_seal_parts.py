"""Large tails are sealed from where their parts lie (AES-256-GCM as a stream): the same bytes as sealing
the gathered plaintext, and frames that round-trip under both suites, whatever the part sizes.
"""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flodld.wire.aead import STREAM_SEAL_MIN, Role, Suite, seal_parts
from flodld.wire.frames import FrameConnection
from flodld.wire.join import RankExited

SALT = bytes(range(16))
SIZES = [0, 1, 15, 17, 65_536 + 3, 1024 * 1024 + 5, 16]


def test_sealing_parts_equals_sealing_the_gathered_plaintext() -> None:
    key, nonce, aad = os.urandom(32), os.urandom(12), b"h" * 24
    pieces = [os.urandom(size) for size in SIZES]
    total = sum(SIZES)
    out = bytearray(total + 16)
    seal_parts(key, nonce, aad, [memoryview(piece) for piece in pieces], memoryview(out))
    assert bytes(out) == AESGCM(key).encrypt(nonce, b"".join(pieces), aad)


@pytest.mark.parametrize("aes", [True, False], ids=["aes-gcm", "chacha20-poly1305"])
def test_large_scatter_tails_round_trip(aes: bool) -> None:
    dialer = FrameConnection(Role.DIALER, SALT, aes=aes)
    listener = FrameConnection(Role.LISTENER, SALT, aes=aes)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    assert dialer.suite is (Suite.AES_256_GCM if aes else Suite.CHACHA20_POLY1305)
    listener.receive_data(dialer.send_message(RankExited(rank=0, code=0)))  # the first frame: small
    listener.next_event()
    parts = [os.urandom(size) for size in SIZES]
    assert sum(SIZES) >= STREAM_SEAL_MIN
    for _ in range(2):
        listener.receive_data(dialer.send_message(RankExited(rank=1, code=0), [memoryview(p) for p in parts]))
        frame = listener.next_event()
        assert frame.message() == RankExited(rank=1, code=0)  # type: ignore[union-attr]
        assert frame.tail == b"".join(parts)  # type: ignore[union-attr]
