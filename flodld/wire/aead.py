"""The frame cipher: the two AEAD suites, the nonces that choose one, the per-direction key schedule, and
sealing/opening a frame body in place. Pure functions over bytes; `flodld.wire.frames` builds the
connection state machine on them.

- Each side's 16-byte nonce carries its cipher flag in the low bit of its first byte (1: its CPU has
  AES instructions). Both sides pick the same AEAD from the two flags: AES-256-GCM when both set theirs,
  ChaCha20-Poly1305 otherwise (`choose_suite`).
- One 32-byte key per direction with HKDF-SHA256: input key the run salt (or, after a rekey, a host
  key or the run salt of an open admission), HKDF salt the two nonces, info a label, the channel's
  magic, the chosen suite and the direction byte (`direction_keys`). Every connection has keys of its
  own: nothing captured on one connection decrypts on another, a connection keyed for one channel
  never decrypts on another, and the flags that chose the cipher are bound into the keys (flipping one
  on the path only makes every frame fail).
- A frame's AEAD nonce is its sender's direction byte, three zero bytes and the frame's 64-bit sequence
  number (`FRAME_NONCE`): the other direction has another key and another nonce, so a frame cannot be
  reflected back to its sender.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from enum import Enum, IntEnum
from typing import Final

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.salt import SALT_BYTES

NONCE_BYTES: Final = 16
TAG_BYTES: Final = 16
KEY_BYTES: Final = 32
AEAD_NONCE_BYTES: Final = 12
KEY_LABEL: Final = b"flodld/aead/v2"
# Bound into the keys of a connection made without a channel (in-memory tests); every socket adapter
# in flodld.net passes its channel, whose 4-byte magic goes here instead.
_NO_CHANNEL: Final = b"\x00\x00\x00\x00"
_AES_FLAG: Final = 0x01


class Role(Enum):
    DIALER = "dialer"
    LISTENER = "listener"


class Suite(IntEnum):
    """The AEAD of a connection; its value is bound into the keys."""

    AES_256_GCM = 1
    CHACHA20_POLY1305 = 2


# The byte that marks each direction: in the key derivation and in every AEAD nonce.
DIRECTION: Final[dict[Role, bytes]] = {Role.DIALER: b"D", Role.LISTENER: b"L"}
PEER: Final[dict[Role, Role]] = {Role.DIALER: Role.LISTENER, Role.LISTENER: Role.DIALER}


@functools.cache
def cpu_has_aes() -> bool:
    """True when /proc/cpuinfo lists the `aes` flag (x86 AES-NI) or the arm `aes` feature."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features") and "aes" in value.split():
                    return True
    except OSError:
        pass
    return False


def choose_suite(dialer_nonce: bytes, listener_nonce: bytes) -> Suite:
    """AES-256-GCM when both sides flagged AES instructions in their nonces, else ChaCha20-Poly1305."""
    if dialer_nonce[0] & listener_nonce[0] & _AES_FLAG:
        return Suite.AES_256_GCM
    return Suite.CHACHA20_POLY1305


def new_nonce(*, aes: bool | None = None) -> bytes:
    """16 random bytes whose first byte's low bit is this side's cipher flag (default: `cpu_has_aes()`)."""
    nonce = bytearray(secrets.token_bytes(NONCE_BYTES))
    flag = cpu_has_aes() if aes is None else aes
    nonce[0] = (nonce[0] & 0xFE) | (_AES_FLAG if flag else 0)
    return bytes(nonce)


def channel_binding(channel: Channel | None) -> bytes:
    """The 4 bytes a channel contributes to its keys: its magic (zeros for no channel)."""
    return _NO_CHANNEL if channel is None else magic_prefix(channel)


def direction_keys(
    key: bytes,
    dialer_nonce: bytes,
    listener_nonce: bytes,
    channel: Channel | None,
    suite: Suite,
    sender: Role,
) -> tuple[bytes, bytes]:
    """The 32-byte AEAD keys of the frames `sender` writes on this connection and of those its peer writes.

    Each is HKDF-SHA256(ikm = key, salt = dialer nonce ‖ listener nonce,
                        info = "flodld/aead/v2" ‖ channel magic ‖ suite (1 byte) ‖ direction byte),
    with one HKDF extract for both (they share the input key and salt; only the info differs). A 32-byte
    output is one expand block.
    """
    prk = hmac.digest(dialer_nonce + listener_nonce, key, hashlib.sha256)
    info = KEY_LABEL + channel_binding(channel) + bytes((int(suite),))
    return (
        hmac.digest(prk, info + DIRECTION[sender] + b"\x01", hashlib.sha256),
        hmac.digest(prk, info + DIRECTION[PEER[sender]] + b"\x01", hashlib.sha256),
    )


def aead_for(suite: Suite, key: bytes) -> AESGCM | ChaCha20Poly1305:
    return AESGCM(key) if suite is Suite.AES_256_GCM else ChaCha20Poly1305(key)


# cryptography >= 45 encrypts and decrypts into a given buffer (no intermediate object); checked once.
_INTO: Final = all(
    hasattr(cls, name) for cls in (AESGCM, ChaCha20Poly1305) for name in ("encrypt_into", "decrypt_into")
)


def _in_place_allowed() -> bool:
    """Whether this cryptography lets `encrypt_into`/`decrypt_into` write over their input. Releases 45-50
    do; 51 refuses any overlap of input and output ("data and buf must not overlap"), exact in-place
    included, so the frame's plaintext is copied out first there (one copy of the frame per seal or open).
    """
    if not _INTO:
        return False
    scratch = memoryview(bytearray(16 + TAG_BYTES))
    try:
        AESGCM(bytes(32)).encrypt_into(bytes(12), scratch[:16], b"", scratch)
    except ValueError:
        return False
    return True


_IN_PLACE: Final = _in_place_allowed()


def seal_in_place(
    aead: AESGCM | ChaCha20Poly1305, nonce: bytes, view: memoryview, size: int, aad: bytes
) -> None:
    """Encrypt view[:size] in place and write the tag after it (view is size + TAG_BYTES long)."""
    if _IN_PLACE:
        aead.encrypt_into(nonce, view[:size], aad, view)
    elif _INTO:  # cryptography >= 51: the input may not overlap the output
        aead.encrypt_into(nonce, bytes(view[:size]), aad, view)
    else:  # pragma: no cover - older cryptography
        view[:] = aead.encrypt(nonce, view[:size], aad)


# A tail at least this large is sealed from where its parts lie (`seal_parts`) instead of being gathered
# into the frame first: one pass over the bytes instead of a copy and a pass.
STREAM_SEAL_MIN: Final = 64 * 1024


def seal_parts(
    key: bytes, nonce: bytes, aad: bytes, pieces: Sequence[memoryview], out: memoryview
) -> None:
    """AES-256-GCM of the concatenated `pieces` into `out` (ciphertext, then the tag), reading each piece
    where it lies: byte for byte what `seal_in_place` makes of the gathered plaintext (GCM is a stream).
    """
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(aad)
    offset = 0
    for piece in pieces:
        count = piece.nbytes
        if count:
            # update_into asks for block_size - 1 bytes of room past the input; GCM writes exactly `count`,
            # and the room lies over the next piece's place or the tag, both written after.
            encryptor.update_into(piece, out[offset : offset + count + 15])
            offset += count
    encryptor.finalize()
    out[offset : offset + TAG_BYTES] = encryptor.tag


def open_in_place(
    aead: AESGCM | ChaCha20Poly1305, nonce: bytes, view: memoryview, size: int, aad: bytes
) -> None:
    """Check the tag at view[size:] and decrypt view[:size] in place (InvalidTag on failure)."""
    if _IN_PLACE:
        aead.decrypt_into(nonce, view, aad, view[:size])
    elif _INTO:  # cryptography >= 51: the input may not overlap the output
        aead.decrypt_into(nonce, bytes(view), aad, view[:size])
    else:  # pragma: no cover - older cryptography
        view[:size] = aead.decrypt(nonce, view, aad)


def open_into(
    aead: AESGCM | ChaCha20Poly1305, nonce: bytes, sealed: memoryview, out: memoryview, size: int, aad: bytes
) -> None:
    """Check the tag of `sealed` and decrypt it into out[:size] (InvalidTag on failure)."""
    if _INTO:
        aead.decrypt_into(nonce, sealed, aad, out[:size])
    else:  # pragma: no cover - older cryptography
        out[:size] = aead.decrypt(nonce, sealed, aad)


def check_key(key: bytes) -> bytes:
    if len(key) != SALT_BYTES:
        raise ValueError(f"a frame key is a {SALT_BYTES}-byte session salt, got {len(key)} bytes")
    return bytes(key)


# The AEAD nonce of a frame: its sender's direction byte, three zero bytes, the 64-bit sequence number.
FRAME_NONCE: Final = struct.Struct("<c3xQ")
