"""Per-host keys: what binds a relay's DATA and CONTROL connections to the host that was admitted.

Every host of a run knows the run salt, so the salt alone cannot tell host "a" from host "b". At
admission both ends of the join connection derive a key that only they know how to compute from
that exchange:

    host_key = HMAC-SHA256(salt, "flodld/host/v1" ‖ u16 len ‖ host ‖ u16 len ‖ run_id
                           ‖ join dialer nonce ‖ join listener nonce)[:16]

The nonces are the join connection's own (fresh per connection, both sides contribute), so a host
readmitted on a new join connection gets a new key. The agent hands its key to its relay through the
environment; the relay proves it on each upstream channel with a `RelayHello.proof` over that
connection's channel magic and nonces, and both sides then rekey the connection to the host key,
so every later frame on it is encrypted and authenticated under keys derived from it
(`flodld.wire.aead.direction_keys`): readable and writable only by that host and the controller.

What this does not do: the join nonces cross the wire in the clear (they are exchanged before any key
exists), so an on-path observer who also holds the salt can compute the key. The per-host key stops
a host from speaking as, or reading the frames of, another host that merely shares the salt; against
an observer who has the salt it adds nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

from flodld.wire.aead import NONCE_BYTES, Role, channel_binding
from flodld.wire.frames import FrameConnection
from flodld.wire.magic import Channel
from flodld.wire.salt import SALT_BYTES

HOST_KEY_LABEL: Final = b"flodld/host/v1"
RELAY_PROOF_LABEL: Final = b"flodld/relay-hello/v1"
HOST_KEY_BYTES: Final = SALT_BYTES
_LEN: Final = struct.Struct("<H")


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"a host-key field is at most 65535 bytes, got {len(raw)}")
    return _LEN.pack(len(raw)) + raw


def _connection_mac(
    key: bytes, key_name: str, key_bytes: int, message: bytes, dialer_nonce: bytes, listener_nonce: bytes
) -> bytes:
    """HMAC-SHA256 under `key` (a `key_name`, `key_bytes` long) of `message` and the connection's nonces."""
    if len(key) != key_bytes:
        raise ValueError(f"a {key_name} is {key_bytes} bytes, got {len(key)}")
    if len(dialer_nonce) != NONCE_BYTES or len(listener_nonce) != NONCE_BYTES:
        raise ValueError(
            f"nonces are {NONCE_BYTES} bytes each, got {len(dialer_nonce)} and {len(listener_nonce)}"
        )
    return hmac.digest(key, message + dialer_nonce + listener_nonce, hashlib.sha256)


def derive_host_key(
    salt: bytes, *, host: str, run_id: str, dialer_nonce: bytes, listener_nonce: bytes
) -> bytes:
    """The 16-byte key of `host`, from the salt and the join connection that admitted it."""
    message = HOST_KEY_LABEL + _field(host) + _field(run_id)
    return _connection_mac(salt, "salt", SALT_BYTES, message, dialer_nonce, listener_nonce)[:HOST_KEY_BYTES]


def join_host_key(salt: bytes, *, host: str, run_id: str, conn: FrameConnection) -> bytes:
    """`derive_host_key` over a join connection's own nonces, from either end of it."""
    peer_nonce = conn.peer_nonce
    if peer_nonce is None:
        raise ValueError("the join connection's nonce exchange has not completed")
    dialer, listener = (conn.nonce, peer_nonce) if conn.role is Role.DIALER else (peer_nonce, conn.nonce)
    return derive_host_key(salt, host=host, run_id=run_id, dialer_nonce=dialer, listener_nonce=listener)


def relay_proof(
    host_key: bytes, *, host: str, channel: Channel, dialer_nonce: bytes, listener_nonce: bytes
) -> str:
    """What a relay puts in `RelayHello.proof`: the host key's MAC over this connection's identity."""
    message = RELAY_PROOF_LABEL + channel_binding(channel) + _field(host)
    return _connection_mac(host_key, "host key", HOST_KEY_BYTES, message, dialer_nonce, listener_nonce).hex()


def verify_relay_proof(
    host_key: bytes, proof: str, *, host: str, channel: Channel, dialer_nonce: bytes, listener_nonce: bytes
) -> bool:
    """Constant-time check of a `RelayHello.proof`."""
    expected = relay_proof(
        host_key, host=host, channel=channel, dialer_nonce=dialer_nonce, listener_nonce=listener_nonce
    )
    return hmac.compare_digest(expected, proof.lower())
