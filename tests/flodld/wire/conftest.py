"""Helpers shared by the wire tests: two in-memory FrameConnections with the handshake done."""

from __future__ import annotations

from flodld.wire.frames import DEFAULT_MAX_TAIL, MAX_PAYLOAD, FrameConnection, Role

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
    caps: dict[str, int] = {"max_payload": max_payload, "max_tail": max_tail}
    if not first_frame_caps:
        caps |= {"preauth_max_payload": max_payload, "preauth_max_tail": max_tail}
    dialer = FrameConnection(Role.DIALER, salt, **caps)
    listener_key = listener_salt if listener_salt is not None else salt
    listener = FrameConnection(Role.LISTENER, listener_key, **caps)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    assert dialer.ready and listener.ready
    return dialer, listener
