"""FrameConnection: handshake, framing, authentication, replay protection and caps, end to end in memory."""

from __future__ import annotations

import array

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodld.wire.aead import channel_binding, choose_suite, direction_keys
from flodld.wire.errors import WireError
from flodld.wire.frames import (
    CLOSED,
    FRAME_MAGIC,
    HEADER,
    HEADER_BYTES,
    NEED_DATA,
    NONCE_BYTES,
    PREAUTH_MAX_PAYLOAD,
    PREAUTH_MAX_TAIL,
    PROTOCOL_VERSION,
    TAG_BYTES,
    BytesLike,
    Frame,
    FrameConnection,
    Role,
    Suite,
)
from flodld.wire.join import Abort, RankExited
from flodld.wire.magic import CHANNEL_MAGICS, Channel, magic_prefix
from tests.flodld.wire.conftest import OTHER_SALT, SALT, connected_pair

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def deliver(receiver: FrameConnection, data: BytesLike) -> Frame:
    receiver.receive_data(data)
    event = receiver.next_event()
    assert isinstance(event, Frame), event
    return event


def expect_error(receiver: FrameConnection, data: BytesLike, code: str) -> WireError:
    receiver.receive_data(data)
    with pytest.raises(WireError) as caught:
        receiver.next_event()
    assert caught.value.code == code, caught.value
    return caught.value


# --- handshake --------------------------------------------------------------------------------------


def _reference_key(key: bytes, nonces: bytes, channel: Channel | None, suite: Suite, byte: bytes) -> bytes:
    """The contract's key of one direction, by cryptography's RFC 5869 HKDF-SHA256."""
    info = b"flodld/aead/v2" + channel_binding(channel) + bytes((int(suite),)) + byte
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=nonces, info=info).derive(key)


def test_direction_keys_bind_salt_channel_suite_direction_and_both_nonces() -> None:
    dialer_nonce, listener_nonce = b"d" * 16, b"l" * 16
    aes, dialer = Suite.AES_256_GCM, Role.DIALER
    magic = magic_prefix(Channel.DATA)
    expected = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=dialer_nonce + listener_nonce,
        info=b"flodld/aead/v2" + magic + bytes((int(aes),)) + b"D",
    ).derive(SALT)
    assert direction_keys(SALT, dialer_nonce, listener_nonce, Channel.DATA, aes, dialer)[0] == expected
    assert direction_keys(SALT, listener_nonce, dialer_nonce, Channel.DATA, aes, dialer)[0] != expected
    assert direction_keys(OTHER_SALT, dialer_nonce, listener_nonce, Channel.DATA, aes, dialer)[0] != expected
    assert direction_keys(SALT, dialer_nonce, listener_nonce, Channel.DATA, aes, Role.LISTENER)[0] != expected
    assert (
        direction_keys(SALT, dialer_nonce, listener_nonce, Channel.DATA, Suite.CHACHA20_POLY1305, dialer)[0]
        != expected
    )
    byte = {Role.DIALER: b"D", Role.LISTENER: b"L"}
    for sender, peer in ((Role.DIALER, Role.LISTENER), (Role.LISTENER, Role.DIALER)):
        for suite in Suite:
            for channel in (Channel.DATA, Channel.JOIN, None):
                assert direction_keys(SALT, dialer_nonce, listener_nonce, channel, suite, sender) == (
                    _reference_key(SALT, dialer_nonce + listener_nonce, channel, suite, byte[sender]),
                    _reference_key(SALT, dialer_nonce + listener_nonce, channel, suite, byte[peer]),
                )
    keys = {
        direction_keys(SALT, dialer_nonce, listener_nonce, channel, aes, dialer)[0]
        for channel in CHANNEL_MAGICS
    }
    assert len(keys) == len(CHANNEL_MAGICS)  # every channel keys differently
    assert direction_keys(SALT, dialer_nonce, listener_nonce, None, aes, dialer)[0] not in keys


@pytest.mark.parametrize(
    ("dialer_aes", "listener_aes", "suite"),
    [
        (True, True, Suite.AES_256_GCM),
        (True, False, Suite.CHACHA20_POLY1305),
        (False, True, Suite.CHACHA20_POLY1305),
        (False, False, Suite.CHACHA20_POLY1305),
    ],
)
def test_the_cipher_is_chosen_from_both_nonces_flags(
    dialer_aes: bool, listener_aes: bool, suite: Suite
) -> None:
    dialer = FrameConnection(Role.DIALER, SALT, aes=dialer_aes)
    listener = FrameConnection(Role.LISTENER, SALT, aes=listener_aes)
    assert choose_suite(dialer.nonce, listener.nonce) is suite
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    assert dialer.suite is listener.suite is suite
    frame = deliver(listener, dialer.send_message(Abort(reason="hello")))
    assert frame.message() == Abort(reason="hello")
    assert deliver(dialer, listener.send_message(Abort(reason="back"))).message() == Abort(reason="back")


def test_a_flipped_cipher_flag_on_the_path_only_breaks_the_connection() -> None:
    """A man in the middle who downgrades AES to ChaCha by flipping a nonce bit gets nothing through."""
    dialer = FrameConnection(Role.DIALER, SALT, aes=True)
    listener = FrameConnection(Role.LISTENER, SALT, aes=True)
    tampered = bytes((dialer.nonce[0] ^ 1,)) + dialer.nonce[1:]
    listener.receive_data(tampered)
    dialer.receive_data(listener.initial_bytes())
    assert (dialer.suite, listener.suite) == (Suite.AES_256_GCM, Suite.CHACHA20_POLY1305)
    expect_error(listener, dialer.send_message(Abort(reason="x")), "bad_tag")


@pytest.mark.parametrize("other", [Channel.RENDEZVOUS, Channel.CONTROL, Channel.JOIN])
def test_a_connection_keyed_for_one_channel_never_verifies_on_another(other: Channel) -> None:
    dialer = FrameConnection(Role.DIALER, SALT, channel=Channel.DATA)
    listener = FrameConnection(Role.LISTENER, SALT, channel=other)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    expect_error(listener, dialer.send_message(Abort(reason="cross-channel")), "bad_tag")


# --- pre-authentication caps ------------------------------------------------------------------------


def test_the_first_frame_is_held_to_the_pre_authentication_caps_from_its_header() -> None:
    _dialer, listener = connected_pair()
    assert (listener.preauth_max_payload, listener.preauth_max_tail) == (
        PREAUTH_MAX_PAYLOAD,
        PREAUTH_MAX_TAIL,
    )
    expect_error(listener, _forged_header(PREAUTH_MAX_PAYLOAD + 1, 0), "too_large")
    _dialer, listener = connected_pair()
    error = expect_error(listener, _forged_header(0, 1), "too_large")  # no tail at all before auth
    assert "pre-authentication" in str(error)


def test_after_the_first_frame_verifies_the_normal_caps_apply() -> None:
    dialer, listener = connected_pair()
    assert not listener.authenticated
    seen: list[str] = []
    listener.on_authenticated = lambda: seen.append("auth")
    deliver(listener, dialer.send_message(Abort(reason="small hello")))
    assert listener.authenticated and seen == ["auth"]
    big = deliver(listener, dialer.send_frame(1, b"p" * (PREAUTH_MAX_PAYLOAD + 1), b"t" * 100_000))
    assert len(big.payload) == PREAUTH_MAX_PAYLOAD + 1 and len(big.tail) == 100_000
    assert seen == ["auth"]  # called once


def test_a_first_frame_that_fails_its_tag_does_not_authenticate() -> None:
    dialer, listener = connected_pair(SALT, listener_salt=OTHER_SALT)
    seen: list[str] = []
    listener.on_authenticated = lambda: seen.append("auth")
    expect_error(listener, dialer.send_message(Abort(reason="wrong key")), "bad_tag")
    assert not listener.authenticated and seen == []


def test_initial_bytes_are_the_nonce_and_fresh_per_connection() -> None:
    first = FrameConnection(Role.DIALER, SALT)
    second = FrameConnection(Role.DIALER, SALT)
    assert len(first.initial_bytes()) == NONCE_BYTES
    assert first.initial_bytes() != second.initial_bytes()
    assert FrameConnection(Role.DIALER, SALT, nonce=b"n" * 16).initial_bytes() == b"n" * 16


def test_dialer_cannot_send_before_the_listener_nonce() -> None:
    dialer = FrameConnection(Role.DIALER, SALT)
    with pytest.raises(WireError) as caught:
        dialer.send_message(Abort(reason="early"))
    assert caught.value.code == "handshake"


def test_listener_may_send_as_soon_as_it_has_the_dialer_nonce() -> None:
    dialer = FrameConnection(Role.DIALER, SALT)
    listener = FrameConnection(Role.LISTENER, SALT)
    listener.receive_data(dialer.initial_bytes())
    assert listener.ready
    frame_bytes = listener.send_message(Abort(reason="go away"))
    dialer.receive_data(listener.initial_bytes() + frame_bytes)  # nonce and first frame in one segment
    event = dialer.next_event()
    assert isinstance(event, Frame)
    assert event.message() == Abort(reason="go away")


def test_nonce_split_across_segments_completes_the_handshake() -> None:
    dialer = FrameConnection(Role.DIALER, SALT)
    listener = FrameConnection(Role.LISTENER, SALT)
    nonce = dialer.initial_bytes()
    listener.receive_data(nonce[:5])
    assert not listener.ready and listener.bytes_wanted == NONCE_BYTES - 5
    assert listener.next_event() is NEED_DATA
    listener.receive_data(nonce[5:])
    assert listener.ready


def test_eof_before_the_nonce_is_a_handshake_error() -> None:
    listener = FrameConnection(Role.LISTENER, SALT)
    listener.receive_data(b"abc")
    expect_error(listener, b"", "handshake")


def test_keys_must_be_sixteen_bytes() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        FrameConnection(Role.DIALER, b"short")
    with pytest.raises(ValueError, match="nonce"):
        FrameConnection(Role.DIALER, SALT, nonce=b"x")


# --- framing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("aes", [True, False])
def test_frame_layout_is_header_then_aead_of_payload_and_tail(aes: bool) -> None:
    dialer = FrameConnection(Role.DIALER, SALT, aes=aes)
    listener = FrameConnection(Role.LISTENER, SALT, aes=aes)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    dialer.send_frame(0x0106, b"{}")  # seq 0
    wire = bytes(dialer.send_frame(0x0106, b'{"reason":"x"}', b"TAIL"))  # seq 1
    magic, version, kind, seq, payload_len, tail_len = HEADER.unpack_from(wire)
    assert (magic, version, kind, seq, payload_len, tail_len) == (
        FRAME_MAGIC,
        PROTOCOL_VERSION,
        0x0106,
        1,
        14,
        4,
    )
    assert PROTOCOL_VERSION == 2
    assert b"reason" not in wire and b"TAIL" not in wire  # encrypted
    suite = Suite.AES_256_GCM if aes else Suite.CHACHA20_POLY1305
    key = direction_keys(SALT, dialer.nonce, listener.nonce, None, suite, Role.DIALER)[0]
    aead = AESGCM(key) if aes else ChaCha20Poly1305(key)
    nonce = b"D\x00\x00\x00" + (1).to_bytes(8, "little")  # direction, zeros, seq
    assert wire[HEADER_BYTES:] == aead.encrypt(nonce, b'{"reason":"x"}TAIL', wire[:HEADER_BYTES])
    assert len(wire) == HEADER_BYTES + 18 + TAG_BYTES


def test_empty_frame_is_header_plus_tag() -> None:
    dialer, listener = connected_pair()
    wire = dialer.send_frame(1, b"")
    assert len(wire) == HEADER_BYTES + TAG_BYTES
    assert deliver(listener, wire) == Frame(1, 0, b"", b"")


def test_message_with_tail_round_trips_both_ways() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    frame = deliver(listener, dialer.send_message(RankExited(rank=3, code=-9), b"\x00\x01"))
    assert frame.message() == RankExited(rank=3, code=-9) and frame.tail == b"\x00\x01"
    assert deliver(dialer, listener.send_message(Abort(reason="bye"))).message() == Abort(reason="bye")


def test_byte_at_a_time_delivery_reassembles_frames_and_wants_exact_sizes() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    wire = bytes(dialer.send_frame(7, b"payload", b"tail")) + dialer.send_frame(8, b"p2")
    events: list[Frame] = []
    for index in range(len(wire)):
        listener.receive_data(wire[index : index + 1])
        while isinstance(event := listener.next_event(), Frame):
            events.append(event)
    assert [(f.kind, f.seq, f.payload, f.tail) for f in events] == [
        (7, 0, b"payload", b"tail"),
        (8, 1, b"p2", b""),
    ]
    assert listener.bytes_wanted == HEADER_BYTES


def test_bytes_wanted_names_the_body_after_the_header() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    wire = dialer.send_frame(7, b"12345", b"678")
    listener.receive_data(wire[:HEADER_BYTES])
    assert listener.next_event() is NEED_DATA
    assert listener.bytes_wanted == 5 + 3 + TAG_BYTES


def test_clean_eof_on_a_frame_boundary_is_closed() -> None:
    dialer, listener = connected_pair()
    deliver(listener, dialer.send_frame(1, b"x"))
    listener.receive_data(b"")
    assert listener.next_event() is CLOSED
    assert listener.next_event() is CLOSED


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 3])
def test_eof_inside_a_frame_is_truncated(cut: int) -> None:
    dialer, listener = connected_pair()
    wire = dialer.send_frame(1, b"abcdef")
    listener.receive_data(wire[:cut])
    listener.next_event()
    expect_error(listener, b"", "truncated")


def test_connection_is_dead_after_an_error() -> None:
    dialer, listener = connected_pair()
    wire = bytearray(dialer.send_frame(1, b"x"))
    wire[-1] ^= 1
    expect_error(listener, bytes(wire), "bad_tag")
    for call in (
        listener.next_event,
        lambda: listener.receive_data(b"more"),
        lambda: listener.send_frame(1, b""),
    ):
        with pytest.raises(WireError) as caught:
            call()
        assert caught.value.code == "closed"


def test_rekey_switches_both_directions_and_sequence_continues() -> None:
    dialer, listener = connected_pair()
    deliver(listener, dialer.send_frame(1, b"before"))
    accept = listener.send_frame(2, b"accept")
    listener.rekey(OTHER_SALT)
    formed = listener.send_frame(3, b"formed")
    dialer.receive_data(bytes(accept) + formed)  # both frames arrive together; the second uses the new key
    assert isinstance(first := dialer.next_event(), Frame) and first.payload == b"accept"
    dialer.rekey(OTHER_SALT)
    assert isinstance(second := dialer.next_event(), Frame) and (second.payload, second.seq) == (b"formed", 1)
    assert deliver(listener, dialer.send_frame(4, b"after")).seq == 1


def test_frame_under_the_old_key_after_rekey_is_rejected() -> None:
    dialer, listener = connected_pair()
    stale = dialer.send_frame(1, b"old key")
    listener.rekey(OTHER_SALT)
    expect_error(listener, stale, "bad_tag")


def test_rekey_needs_the_handshake() -> None:
    with pytest.raises(WireError) as caught:
        FrameConnection(Role.DIALER, SALT).rekey(OTHER_SALT)
    assert caught.value.code == "handshake"


# --- rejection ---------------------------------------------------------------------------------------


def test_wrong_salt_is_bad_tag() -> None:
    dialer, listener = connected_pair(SALT, listener_salt=OTHER_SALT)
    expect_error(listener, dialer.send_frame(1, b"x"), "bad_tag")


def test_reflected_frame_is_rejected_by_its_sender() -> None:
    dialer, _listener = connected_pair()
    expect_error(dialer, dialer.send_frame(1, b"echo me"), "bad_tag")


def test_replay_on_the_same_connection_is_rejected() -> None:
    dialer, listener = connected_pair()
    wire = dialer.send_frame(1, b"once")
    deliver(listener, wire)
    expect_error(listener, wire, "replay")


def test_replay_on_a_fresh_connection_is_rejected() -> None:
    dialer, listener = connected_pair()
    captured = dialer.send_frame(1, b"captured")
    deliver(listener, captured)
    # The attacker even replays the original dialer nonce; the listener's fresh nonce changes the key.
    fresh = FrameConnection(Role.LISTENER, SALT)
    fresh.receive_data(dialer.nonce)
    expect_error(fresh, captured, "bad_tag")


def test_reordered_frames_are_rejected() -> None:
    dialer, listener = connected_pair()
    _first, second = dialer.send_frame(1, b"a"), dialer.send_frame(1, b"b")
    expect_error(listener, second, "replay")


def test_bad_magic_and_version_are_rejected_from_the_header() -> None:
    dialer, listener = connected_pair()
    wire = bytearray(dialer.send_frame(1, b"x"))
    wire[0] ^= 0xFF
    expect_error(listener, bytes(wire[:HEADER_BYTES]), "bad_magic")
    dialer, listener = connected_pair()
    wire = bytearray(dialer.send_frame(1, b"x"))
    wire[4] = 1  # an old (version 1, cleartext) peer
    error = expect_error(listener, bytes(wire[:HEADER_BYTES]), "bad_version")
    assert "version 1" in str(error) and f"version {PROTOCOL_VERSION}" in str(error)


def test_sending_over_the_caps_is_refused() -> None:
    dialer, _listener = connected_pair(max_payload=8, max_tail=4)
    with pytest.raises(WireError) as caught:
        dialer.send_frame(1, b"x" * 9)
    assert caught.value.code == "too_large"
    with pytest.raises(WireError) as caught:
        dialer.send_frame(1, b"", b"t" * 5)
    assert caught.value.code == "too_large"


def _forged_header(payload_len: int, tail_len: int) -> bytes:
    return HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 1, 0, payload_len, tail_len)


@pytest.mark.parametrize(("payload_len", "tail_len"), [(16 * 1024 * 1024 + 1, 0), (0, 2**32 - 1)])
def test_default_caps_refuse_a_claimed_length_from_the_header_alone(payload_len: int, tail_len: int) -> None:
    _dialer, listener = connected_pair()
    listener.receive_data(_forged_header(payload_len, tail_len))
    with pytest.raises(WireError) as caught:
        listener.next_event()  # not one body byte was fed
    assert caught.value.code == "too_large"


# --- properties ---------------------------------------------------------------------------------------

frames_strategy = st.lists(
    st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=300), st.binary(max_size=300)),
    min_size=1,
    max_size=6,
)


@PROPERTY
@given(frames=frames_strategy, direction=st.sampled_from(["dial", "listen"]), chunk=st.integers(1, 64))
def test_any_frame_sequence_round_trips(
    frames: list[tuple[int, bytes, bytes]], direction: str, chunk: int
) -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    sender, receiver = (dialer, listener) if direction == "dial" else (listener, dialer)
    wire = b"".join(sender.send_frame(kind, payload, tail) for kind, payload, tail in frames)
    received = []
    for start in range(0, len(wire), chunk):
        receiver.receive_data(wire[start : start + chunk])
        while isinstance(event := receiver.next_event(), Frame):
            received.append(event)
    assert received == [Frame(kind, seq, payload, tail) for seq, (kind, payload, tail) in enumerate(frames)]


@PROPERTY
@given(
    payload=st.binary(max_size=64), tail=st.binary(max_size=64), data=st.data(), preceding=st.integers(0, 2)
)
def test_any_single_bit_flip_is_rejected(
    payload: bytes, tail: bytes, data: st.DataObject, preceding: int
) -> None:
    dialer, listener = connected_pair()
    for _ in range(preceding):
        deliver(listener, dialer.send_frame(5, b"ok"))
    wire = bytearray(dialer.send_frame(9, payload, tail))
    bit = data.draw(st.integers(0, len(wire) * 8 - 1), label="bit")
    wire[bit // 8] ^= 1 << (bit % 8)
    listener.receive_data(bytes(wire))
    listener.receive_data(b"")  # a flipped length must not leave the frame waiting for bytes forever
    with pytest.raises(WireError) as caught:
        listener.next_event()
    assert caught.value.code in {"bad_magic", "bad_version", "too_large", "bad_tag", "truncated"}


@PROPERTY
@given(key=st.binary(min_size=16, max_size=16), payload=st.binary(max_size=64))
def test_any_wrong_key_is_rejected(key: bytes, payload: bytes) -> None:
    dialer, listener = connected_pair(SALT, listener_salt=key if key != SALT else OTHER_SALT)
    expect_error(listener, dialer.send_frame(3, payload), "bad_tag")


@PROPERTY
@given(count=st.integers(2, 6), data=st.data())
def test_any_replayed_or_reordered_frame_is_rejected(count: int, data: st.DataObject) -> None:
    dialer, listener = connected_pair()
    wires = [dialer.send_frame(1, f"frame {index}".encode()) for index in range(count)]
    delivered = data.draw(st.integers(0, count - 1), label="delivered in order")
    for wire in wires[:delivered]:
        deliver(listener, wire)
    offender = data.draw(
        st.sampled_from([index for index in range(count) if index != delivered]), label="out-of-order frame"
    )
    expect_error(listener, wires[offender], "replay")


@PROPERTY
@given(
    max_payload=st.integers(0, 1024),
    max_tail=st.integers(0, 1024),
    excess=st.integers(1, 2**20),
    which=st.sampled_from(["payload", "tail"]),
)
def test_any_over_cap_length_is_rejected_before_the_body(
    max_payload: int, max_tail: int, excess: int, which: str
) -> None:
    _dialer, listener = connected_pair(max_payload=max_payload, max_tail=max_tail)
    claimed = (max_payload + excess, 0) if which == "payload" else (0, max_tail + excess)
    listener.receive_data(_forged_header(*claimed))
    with pytest.raises(WireError) as caught:
        listener.next_event()
    assert caught.value.code == "too_large"


def test_tail_may_be_any_buffer_and_is_counted_in_bytes() -> None:
    floats = array.array("f", [1.0, 2.0, 3.0])
    dialer, listener = connected_pair(max_tail=12, first_frame_caps=False)
    frame = deliver(listener, dialer.send_frame(1, b"", memoryview(floats)))
    assert frame.tail == floats.tobytes() and len(frame.tail) == 12
    with pytest.raises(WireError) as caught:
        dialer.send_frame(1, b"", memoryview(array.array("f", [0.0] * 4)))
    assert caught.value.code == "too_large"


def test_no_plaintext_of_payload_or_tail_reaches_the_wire() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    secret = b"gradient-secret-0123456789" * 40
    wire = bytes(dialer.send_frame(1, b'{"host":"secret-host.example"}', secret))
    assert b"secret-host" not in wire and b"gradient-secret" not in wire
    assert deliver(listener, wire).tail == secret


def test_scatter_tail_parts_are_gathered_into_one_frame() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    parts: list[BytesLike] = [b"ab", memoryview(array.array("f", [1.0])), bytearray(b"cd"), b""]
    frame = deliver(listener, dialer.send_frame(1, b"p", parts))
    assert frame.tail == b"ab" + array.array("f", [1.0]).tobytes() + b"cd"


def test_a_shell_may_read_the_body_straight_into_the_frame_buffer() -> None:
    dialer, listener = connected_pair(first_frame_caps=False)
    wire = bytes(dialer.send_frame(4, b"payload", b"t" * 1000))
    listener.receive_data(wire[:HEADER_BYTES])
    assert listener.next_event() is NEED_DATA
    rest = wire[HEADER_BYTES:]
    while (view := listener.receive_buffer()) is not None and len(view):
        count = min(len(view), 100)
        view[:count] = rest[:count]
        rest = rest[count:]
        listener.receive_filled(count)
    frame = listener.next_event()
    assert isinstance(frame, Frame) and frame.tail == b"t" * 1000 and frame.payload == b"payload"


def test_start_body_parses_a_whole_header_early_under_the_same_caps() -> None:
    """`start_body` takes a header that has arrived whole, so its body goes to `receive_buffer` at once;
    with part of a header it does nothing, and an over-cap header is refused there as `next_event` would.
    """
    dialer, listener = connected_pair(max_tail=2000, first_frame_caps=False)
    wire = bytes(dialer.send_frame(4, b"payload", b"t" * 1000))
    listener.receive_data(wire[: HEADER_BYTES - 1])
    listener.start_body()
    assert listener.receive_buffer() is None  # no header yet: nothing to read a body into
    listener.receive_data(wire[HEADER_BYTES - 1 : HEADER_BYTES])
    listener.start_body()
    view = listener.receive_buffer()
    assert view is not None and listener.bytes_wanted == len(wire) - HEADER_BYTES
    view[: len(wire) - HEADER_BYTES] = wire[HEADER_BYTES:]
    listener.receive_filled(len(wire) - HEADER_BYTES)
    frame = listener.next_event()
    assert isinstance(frame, Frame) and frame.tail == b"t" * 1000 and frame.payload == b"payload"
    big = bytes(dialer.send_frame(4, b"", b"t" * 1000))
    _, small_listener = connected_pair(max_tail=999, first_frame_caps=False)
    small_listener.receive_data(big[:HEADER_BYTES])
    with pytest.raises(WireError) as caught:
        small_listener.start_body()
    assert caught.value.code == "too_large"


def test_sending_stops_before_a_sequence_number_could_repeat() -> None:
    dialer, _listener = connected_pair()
    dialer._send_seq = dialer._send_limit  # as if every sequence number this key may use were spent
    with pytest.raises(WireError) as caught:
        dialer.send_frame(1, b"x")
    assert caught.value.code == "closed"


def _pair_on(
    channel: Channel,
    *,
    dialer_nonce: bytes | None = None,
    listener_nonce: bytes | None = None,
    listener_channel: Channel | None = None,
) -> tuple[FrameConnection, FrameConnection]:
    dialer = FrameConnection(Role.DIALER, SALT, channel=channel, nonce=dialer_nonce)
    listener = FrameConnection(Role.LISTENER, SALT, channel=listener_channel or channel, nonce=listener_nonce)
    listener.receive_data(dialer.initial_bytes())
    dialer.receive_data(listener.initial_bytes())
    return dialer, listener


ALL_CHANNELS = [Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL]


@pytest.mark.parametrize("channel", ALL_CHANNELS)
@pytest.mark.parametrize("attack", ["tampered", "replayed", "reordered", "cross_channel"])
def test_every_channel_refuses_a_tampered_replayed_reordered_or_cross_channel_frame(
    channel: Channel, attack: str
) -> None:
    dialer, listener = _pair_on(channel)
    first, second = dialer.send_frame(1, b'{"a":1}', b""), dialer.send_frame(2, b'{"b":2}')
    if attack == "tampered":
        wire = bytearray(first)
        wire[HEADER_BYTES + 2] ^= 0x01  # one ciphertext bit
        expect_error(listener, bytes(wire), "bad_tag")
    elif attack == "replayed":
        deliver(listener, first)
        expect_error(listener, first, "replay")
    elif attack == "reordered":
        expect_error(listener, second, "replay")
    else:
        # Same salt, same nonces, other channel: the channel's magic alone changes every key.
        other = next(c for c in ALL_CHANNELS if c is not channel)
        _, foreign = _pair_on(other, dialer_nonce=dialer.nonce, listener_nonce=listener.nonce)
        expect_error(foreign, first, "bad_tag")


def test_large_frames_round_trip_through_reused_buffers() -> None:
    """Frames of LARGE_FRAME bytes and more: built in a reused send buffer, read into a recycled body."""
    from flodld.wire.frames import LARGE_FRAME

    dialer, listener = connected_pair(first_frame_caps=False)
    spare = bytearray(LARGE_FRAME + 4096)
    previous: Frame | None = None
    for index in range(4):
        tail = bytes([index]) * (LARGE_FRAME + index)
        wire = bytes(dialer.send_frame(7, b'{"i":%d}' % index, tail, buffer=spare if index else None))
        assert tail[:64] not in wire
        if previous is not None:
            listener.recycle(previous)  # the earlier frame's buffer is read into again
        frame = deliver(listener, wire)
        assert frame.payload == b'{"i":%d}' % index and frame.tail == tail
        previous = frame


def test_two_large_frame_buffers_given_back_are_both_read_into_again() -> None:
    """A connection keeps up to two recycled bodies (RECYCLE_KEEP): while one frame waits (a chunk parked
    for a member before it), the next is read into a fresh map, and once both are given back the next two
    frames reuse both, with no fresh map each time a frame waited.
    """
    from flodld.wire.frames import LARGE_FRAME, RECYCLE_KEEP

    assert RECYCLE_KEEP == 2
    dialer, listener = connected_pair(first_frame_caps=False)
    deliver(listener, bytes(dialer.send_frame(7, b"{}")))  # authenticated: large bodies go to maps

    def frame_of(index: int) -> Frame:
        tail = bytes([index]) * (LARGE_FRAME + 100)
        frame = deliver(listener, bytes(dialer.send_frame(7, b'{"i":%d}' % index, tail)))
        assert frame.tail == tail and frame.body is not None
        return frame

    def buffer(frame: Frame) -> object:
        assert frame.body is not None
        return frame.body.obj

    first, second = frame_of(0), frame_of(1)  # both held at once
    maps = [buffer(first), buffer(second)]  # held here: no id is reused by a later map
    assert maps[0] is not maps[1]
    listener.recycle(first)
    listener.recycle(second)
    third, fourth = frame_of(2), frame_of(3)
    assert {id(buffer(third)), id(buffer(fourth))} == {id(maps[0]), id(maps[1])}
    listener.recycle(third)
    small = deliver(listener, bytes(dialer.send_frame(7, b"{}", b"x" * 10)))  # no large buffer taken
    assert small.tail == b"x" * 10
    assert any(buffer(frame_of(4)) is kept for kept in maps)


def test_a_large_claimed_body_commits_memory_only_for_what_arrived() -> None:
    """Past LARGE_FRAME the body lives in a lazily committed map: resident memory follows the bytes that
    arrived, not the length the header claims (tracemalloc does not see maps, so this reads RSS).
    """
    import resource

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    dialer, listener = connected_pair()
    listener.receive_data(dialer.send_frame(1, b"first"))
    assert isinstance(listener.next_event(), Frame)
    listener.receive_data(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 2, 1, 0, 1024 * 2**20))  # claims 1 GiB
    before = rss()
    for _ in range(16):
        listener.receive_data(bytes(64 * 1024))
        assert listener.next_event() is NEED_DATA
    assert rss() - before < 64 * 2**20, "a 1 GiB claim committed far more than the 1 MiB that arrived"


@pytest.mark.parametrize("in_place", [True, False])
def test_sealing_and_opening_in_place_agree_whether_or_not_cryptography_allows_overlap(
    in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `cryptography` package from 51 on refuses `*_into` calls whose input overlaps their output
    (in-place included); the frame code then copies the plaintext out first. Both roads give the same
    sealed bytes and open them.
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from flodld.wire import aead

    key, nonce, header = bytes(range(32)), bytes(range(12)), b"frame header"
    plain = bytes(range(256)) * 5
    frame = memoryview(bytearray(plain + bytes(aead.TAG_BYTES)))
    if in_place and not aead._IN_PLACE:  # this release refuses it, as the probe found: the copy road runs
        with pytest.raises(ValueError, match="overlap"):
            AESGCM(key).encrypt_into(nonce, frame[: len(plain)], header, frame)
        return
    monkeypatch.setattr(aead, "_IN_PLACE", in_place)
    aead.seal_in_place(AESGCM(key), nonce, frame, len(plain), header)
    assert bytes(frame) == AESGCM(key).encrypt(nonce, plain, header)
    aead.open_in_place(AESGCM(key), nonce, frame, len(plain), header)
    assert bytes(frame[: len(plain)]) == plain
