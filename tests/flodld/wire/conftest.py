"""Helpers shared by the wire tests: two in-memory FrameConnections with the handshake done."""

from __future__ import annotations

from flodld.wire.frames import (
    DEFAULT_MAX_TAIL,
    MAX_PAYLOAD,
    PREAUTH_MAX_PAYLOAD,
    PREAUTH_MAX_TAIL,
    FrameConnection,
    Role,
)

SALT = bytes(range(16))
OTHER_SALT = bytes(range(16, 32))


def connected_pair(
    salt: bytes = SALT,
    listener_salt: bytes | None = None,
    *,
    max_payload: int = MAX_PAYLOAD,
    max_tail: int = DEFAULT_MAX_TAIL,
    first_frame_caps: bool = True,
) -> tuple[FrameConnection, FrameConnection]:
    """(dialer, listener) after exchanging nonces in memory.

    With `first_frame_caps=False` the first received frame gets the normal caps instead of the small
    pre-authentication ones (for tests of framing mechanics that put a tail on frame 0).
    """
    first_payload = PREAUTH_MAX_PAYLOAD if first_frame_caps else max_payload
    first_tail = PREAUTH_MAX_TAIL if first_frame_caps else max_tail

    def side(role: Role, key: bytes) -> FrameConnection:
        return FrameConnection(
            role, key, max_payload=max_payload, max_tail=max_tail,
            preauth_max_payload=first_payload, preauth_max_tail=first_tail,
        )  # fmt: skip

    dialer = side(Role.DIALER, salt)
    listener = side(Role.LISTENER, listener_salt if listener_salt is not None else salt)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    assert dialer.ready and listener.ready
    return dialer, listener
