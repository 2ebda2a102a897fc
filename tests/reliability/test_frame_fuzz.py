"""Fuzz the frame decoder with hostile byte streams.

Only WireError, never an allocation of the claimed size.
"""

from __future__ import annotations

import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodld.wire import frames as wf
from flodld.wire.errors import WIRE_ERROR_CODES, WireError
from flodld.wire.salt import new_salt

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Every wire code but the message layer's two: bytes fed to the frame decoder can raise no other.
KNOWN_CODES = WIRE_ERROR_CODES - {"unknown_kind", "bad_payload"}
SMALL_PAYLOAD, SMALL_TAIL = 256, 512
LARGEST_UNIT = wf.HEADER_BYTES + SMALL_PAYLOAD + SMALL_TAIL + wf.TAG_BYTES


def _pair(salt: bytes) -> tuple[wf.FrameConnection, wf.FrameConnection]:
    dialer = wf.FrameConnection(wf.Role.DIALER, salt, max_payload=SMALL_PAYLOAD, max_tail=SMALL_TAIL)
    listener = wf.FrameConnection(wf.Role.LISTENER, salt, max_payload=SMALL_PAYLOAD, max_tail=SMALL_TAIL)
    dialer.receive_data(listener.initial_bytes())
    listener.receive_data(dialer.initial_bytes())
    return dialer, listener


def _feed(
    conn: wf.FrameConnection, data: bytes | bytearray | memoryview, chunk: int, eof: bool
) -> tuple[list[wf.Frame], WireError | None]:
    """Feed in chunks, draining events after each; the unit the decoder asks for never exceeds the caps."""
    frames: list[wf.Frame] = []
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] + ([b""] if eof else [])
    try:
        for piece in pieces:
            conn.receive_data(piece)
            while True:
                assert conn.bytes_wanted <= LARGEST_UNIT
                event = conn.next_event()
                if event is wf.NEED_DATA or event is wf.CLOSED:
                    break
                assert isinstance(event, wf.Frame)
                frames.append(event)
    except WireError as error:
        assert error.code in KNOWN_CODES, error.code
        assert str(error)
        return frames, error
    return frames, None


@FUZZ
@given(data=st.binary(max_size=2048), chunk=st.integers(1, 97), eof=st.booleans())
def test_arbitrary_bytes_from_a_peer_without_the_salt_never_yield_a_frame(
    data: bytes, chunk: int, eof: bool
) -> None:
    listener = wf.FrameConnection(
        wf.Role.LISTENER, new_salt(), max_payload=SMALL_PAYLOAD, max_tail=SMALL_TAIL
    )
    frames, error = _feed(listener, data, chunk, eof)
    assert frames == []
    if error is not None:
        # A dead connection stays dead: later use is `closed`, whatever arrives.
        try:
            listener.receive_data(b"more")
        except WireError as again:
            assert again.code == "closed"
        else:
            raise AssertionError("a failed connection accepted more bytes")


@FUZZ
@given(
    magic=st.one_of(st.just(wf.FRAME_MAGIC), st.integers(0, 2**32 - 1)),
    version=st.one_of(st.just(wf.PROTOCOL_VERSION), st.integers(0, 2**16 - 1)),
    kind=st.integers(0, 2**16 - 1),
    seq=st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
    payload_len=st.one_of(st.integers(0, SMALL_PAYLOAD), st.integers(0, 2**32 - 1)),
    tail_len=st.one_of(st.integers(0, SMALL_TAIL), st.integers(0, 2**32 - 1)),
    body=st.binary(max_size=600),
    chunk=st.integers(1, 64),
)
def test_forged_headers_are_refused_in_the_documented_order(
    magic: int, version: int, kind: int, seq: int, payload_len: int, tail_len: int, body: bytes, chunk: int
) -> None:
    _, listener = _pair(new_salt())
    header = wf.HEADER.pack(magic, version, kind, seq, payload_len, tail_len)
    frames, error = _feed(listener, header + body, chunk, eof=True)
    assert frames == []  # no tag was computed with the session key
    assert error is not None
    if magic != wf.FRAME_MAGIC:
        expected = "bad_magic"
    elif version != wf.PROTOCOL_VERSION:
        expected = "bad_version"
    elif payload_len > listener.preauth_max_payload or tail_len > listener.preauth_max_tail:
        expected = "too_large"  # the first frame is held to the small pre-authentication caps
    elif len(body) < payload_len + tail_len + wf.TAG_BYTES:
        expected = "truncated"
    else:
        expected = "bad_tag"
    assert error.code == expected


@FUZZ
@given(
    count=st.integers(1, 5),
    cut=st.integers(0, 400),
    garbage=st.binary(min_size=1, max_size=64),
    chunk=st.integers(1, 50),
)
def test_garbage_spliced_into_a_valid_stream_kills_the_connection_after_the_good_frames(
    count: int, cut: int, garbage: bytes, chunk: int
) -> None:
    dialer, listener = _pair(new_salt())
    wire = b"".join(dialer.send_frame(0x0101, b'{"n":%d}' % i) for i in range(count))
    cut = min(cut, len(wire))
    spliced = wire[:cut] + garbage + wire[cut:]
    frames, error = _feed(listener, spliced, chunk, eof=True)
    frame_bytes = len(wire) // count
    intact = cut // frame_bytes
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert intact <= len(frames) <= count
    if len(frames) < count:
        assert error is not None


def test_a_claimed_length_just_under_the_default_caps_allocates_only_what_arrived() -> None:
    """After authentication a header may promise 16 MiB of payload and 1 GiB of tail; memory follows the bytes
    actually sent. Before it, the first frame is capped small: see the pre-authentication tests.
    """
    salt = new_salt()
    dialer = wf.FrameConnection(wf.Role.DIALER, salt)
    listener = wf.FrameConnection(wf.Role.LISTENER, salt)
    dialer.receive_data(listener.initial_bytes())
    listener.receive_data(dialer.initial_bytes())
    listener.receive_data(dialer.send_frame(1, b"first"))
    assert isinstance(listener.next_event(), wf.Frame) and listener.authenticated
    header = wf.HEADER.pack(wf.FRAME_MAGIC, wf.PROTOCOL_VERSION, 0x0202, 1, 16 * 2**20, 2**30)
    tracemalloc.start()
    try:
        listener.receive_data(header)
        assert listener.next_event() is wf.NEED_DATA
        for _ in range(64):
            listener.receive_data(bytes(1024))
            assert listener.next_event() is wf.NEED_DATA
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert listener.bytes_wanted == 16 * 2**20 + 2**30 + wf.TAG_BYTES - 64 * 1024
    assert peak < 4 * 2**20, f"decoder allocated {peak} bytes for 64 KiB of input"


@given(payload_len=st.integers(16 * 2**20 + 1, 2**32 - 1), tail_len=st.integers(2**30 + 1, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_an_over_cap_claim_is_refused_before_any_body_byte(payload_len: int, tail_len: int) -> None:
    for claim in ((payload_len, 0), (0, tail_len)):
        listener = wf.FrameConnection(wf.Role.LISTENER, new_salt())
        listener.receive_data(bytes(wf.NONCE_BYTES))
        listener.receive_data(wf.HEADER.pack(wf.FRAME_MAGIC, wf.PROTOCOL_VERSION, 1, 0, *claim))
        try:
            listener.next_event()
        except WireError as error:
            assert error.code == "too_large"
            assert str(claim[0] or claim[1]) in str(error)
        else:
            raise AssertionError(f"claim {claim} was not refused from the header")


def test_frames_reordered_across_two_connections_of_the_same_run_are_refused() -> None:
    salt = new_salt()
    dialer_a, listener_a = _pair(salt)
    dialer_b, listener_b = _pair(salt)
    first_on_a = dialer_a.send_frame(0x0101, b"{}")
    dialer_b.send_frame(0x0101, b"{}")
    second_on_b = dialer_b.send_frame(0x0101, b"{}")
    _, error = _feed(listener_b, first_on_a, 7, eof=False)
    assert error is not None and error.code == "bad_tag"
    _, error = _feed(listener_a, second_on_b, 7, eof=False)
    assert error is not None and error.code == "bad_tag"


def test_seq_field_is_authenticated_so_renumbering_a_replay_fails_the_tag() -> None:
    dialer, listener = _pair(new_salt())
    frame = dialer.send_frame(0x0101, b"{}")
    frames, error = _feed(listener, frame, 40, eof=False)
    assert len(frames) == 1 and error is None
    renumbered = bytearray(frame)
    struct.pack_into("<Q", renumbered, 8, 1)
    _, error = _feed(listener, bytes(renumbered), 40, eof=False)
    assert error is not None and error.code == "bad_tag"
