"""The TCPStore codec (flodld.wire.tcpstore) against bytes recorded between torch 2.13's TCPStore client and
torch's own (libuv) server, through a logging proxy: every request the client sent decodes to the request
we expect, and every reply we encode is byte for byte what torch's server answered.
"""

from __future__ import annotations

import struct

import pytest

from flodld.wire import tcpstore as ts

# (client bytes, request, server reply bytes), in the recorded order (one connection).
RECORDED: list[tuple[str, ts.Request, str]] = [
    ("00cef7853c", ts.Validate(0x3C85F7CE), ""),
    ("0d5d3f0000", ts.Ping(0x3F5D), "5d3f0000"),
    ("040500000000000000696e69742f0100000000000000", ts.Add("init/", 1), "0100000000000000"),
    ("0102000000000000002f6b02000000000000007631", ts.Set("/k", b"v1"), ""),
    ("06010000000000000002000000000000002f6b", ts.Wait(("/k",)), "00"),
    ("0302000000000000002f6b", ts.Get("/k"), "02000000000000007631"),
    ("0402000000000000002f6e0500000000000000", ts.Add("/n", 5), "0500000000000000"),
    (
        "0202000000000000002f6b0200000000000000763102000000000000007632",
        ts.CompareSet("/k", b"v1", b"v2"),
        "02000000000000007632",
    ),
    (
        "0203000000000000002f7a7a010000000000000078010000000000000079",
        ts.CompareSet("/zz", b"x", b"y"),
        "010000000000000078",
    ),
    ("05020000000000000002000000000000002f6b05000000000000002f6e6f7065", ts.Check(("/k", "/nope")), "01"),
    ("07", ts.NumKeys(), "0400000000000000"),
    ("0802000000000000002f6e", ts.DeleteKey("/n"), "0100000000000000"),
    ("0902000000000000002f6b02000000000000002b2b", ts.Append("/k", b"++"), ""),
    (
        "0a020000000000000002000000000000002f6b02000000000000002f6b",
        ts.MultiGet(("/k", "/k")),
        "040000000000000076322b2b040000000000000076322b2b",
    ),
    (
        "0b020000000000000002000000000000002f6101000000000000003102000000000000002f6202000000000000003232",
        ts.MultiSet(("/a", "/b"), (b"1", b"22")),
        "",
    ),
    ("0e02000000000000002f7102000000000000007171", ts.QueuePush("/q", b"qq"), ""),
    ("1002000000000000002f71", ts.QueueLen("/q"), "0100000000000000"),
    ("0f02000000000000002f71", ts.QueuePop("/q"), "010000000000000002000000000000007171"),
    (
        "11",
        ts.ListKeys(),
        "050000000000000002000000000000002f6102000000000000002f6203000000000000002f7a7a0200000000"
        "0000002f6b0500000000000000696e69742f",
    ),
    ("06010000000000000006000000000000002f6e65766572", ts.Wait(("/never",)), ""),
    ("0c", ts.CancelWait(), "01"),
]


# What torch's server answered in the recording to requests whose reply depends only on their type.
_REPLY_BY_TYPE: dict[type, bytes] = {
    ts.Get: ts.reply_value(b"v1"),
    ts.Check: ts.reply_check(False),
    ts.NumKeys: ts.reply_int(4),
    ts.DeleteKey: ts.reply_deleted(True),
    ts.QueueLen: ts.reply_int(1),
    ts.QueuePop: ts.reply_queue_pop(b"qq"),
    ts.ListKeys: ts.reply_keys(["/a", "/b", "/zz", "/k", "init/"]),
    ts.CancelWait: ts.reply_wait_canceled(),
}


def _reply_for(request: ts.Request) -> bytes:
    """What torch's server answered in the recording, built with our encoders."""
    match request:
        case ts.Ping(nonce):
            return ts.reply_ping(nonce)
        case ts.Add("init/", _):
            return ts.reply_int(1)
        case ts.Add(_, amount):
            return ts.reply_int(amount)
        case ts.Wait(("/k",)):
            return ts.reply_stop_waiting()
        case ts.CompareSet("/k", _, desired):
            return ts.reply_value(desired)
        case ts.CompareSet(_, expected, _):
            return ts.reply_value(expected)  # absent key, non-empty expected: the expected value comes back
        case ts.MultiGet(keys):
            return ts.reply_values([b"v2++" for _ in keys])
    return _REPLY_BY_TYPE.get(type(request), b"")


def test_the_recorded_session_decodes_request_by_request_and_our_replies_match_torchs() -> None:
    codec = ts.TcpStoreServerConnection()
    for sent, expected, reply in RECORDED:
        codec.receive_data(bytes.fromhex(sent))
        assert codec.next_request() == expected
        assert codec.next_request() is None
        if not (isinstance(expected, ts.Wait) and expected.keys == ("/never",)):
            assert _reply_for(expected).hex() == reply, expected


def test_one_byte_at_a_time_and_all_at_once_decode_the_same() -> None:
    stream = b"".join(bytes.fromhex(sent) for sent, _, _ in RECORDED)
    expected = [request for _, request, _ in RECORDED]
    trickled = ts.TcpStoreServerConnection()
    got = []
    for byte in stream:
        trickled.receive_data(bytes([byte]))
        while (request := trickled.next_request()) is not None:
            got.append(request)
    assert got == expected
    whole = ts.TcpStoreServerConnection()
    whole.receive_data(stream)
    assert [whole.next_request() for _ in expected] == expected


def test_empty_queue_pop_and_absent_delete_and_ready_check_replies() -> None:
    assert ts.reply_queue_pop(None).hex() == "0000000000000000"  # recorded: pop of an empty queue
    assert ts.reply_deleted(False).hex() == "0000000000000000"
    assert ts.reply_check(True).hex() == "00"


def _validated() -> ts.TcpStoreServerConnection:
    codec = ts.TcpStoreServerConnection()
    codec.receive_data(bytes.fromhex("00cef7853c"))
    assert codec.next_request() == ts.Validate(ts.VALIDATION_MAGIC)
    return codec


@pytest.mark.parametrize(
    ("first", "match"),
    [
        (b"POST / HTTP/1.1\r\n", "unknown query type 80"),  # a web page posting to the loopback port
        (bytes.fromhex("0d5d3f0000"), "first request must be VALIDATE"),
        (bytes.fromhex("00efbeadde"), "wrong magic 0xdeadbeef"),
    ],
)
def test_a_peer_that_is_not_a_torch_client_is_refused_on_its_first_request(first: bytes, match: str) -> None:
    codec = ts.TcpStoreServerConnection()
    codec.receive_data(first)
    with pytest.raises(ts.TcpStoreProtocolError, match=match):
        codec.next_request()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x01" + struct.pack("<Q", 2**62), "key of .* bytes is over"),
        (
            b"\x01" + struct.pack("<Q", 2) + b"/k" + struct.pack("<Q", ts.MAX_VALUE_BYTES + 1),
            "value of .* over",
        ),
        (b"\x06" + struct.pack("<Q", ts.MAX_KEYS + 1), "keys in one request"),
        (b"\x01" + struct.pack("<Q", ts.MAX_KEY_BYTES + 1), "key of 8192 bytes is over the 8191-byte cap"),
        (  # a key list over the per-request budget, refused at the key that crosses it
            b"\x06" + struct.pack("<Q", ts.MAX_KEYS)
            + (struct.pack("<Q", ts.MAX_KEY_BYTES) + b"k" * ts.MAX_KEY_BYTES)
            * (ts.MAX_KEY_LIST_BYTES // ts.MAX_KEY_BYTES)
            + struct.pack("<Q", ts.MAX_KEY_BYTES),
            "keys over 8388608 bytes in one request",
        ),
        (b"\x01" + struct.pack("<Q", 0), "empty key"),
        (b"\x03" + struct.pack("<Q", 1) + b"\xff", "not UTF-8"),
        (bytes.fromhex("00cef7853c"), "VALIDATE sent twice"),
    ],
)
def test_lengths_and_counts_are_capped_before_anything_is_allocated(data: bytes, match: str) -> None:
    codec = _validated()
    codec.receive_data(data)  # only the header: the cap trips before the announced bytes arrive
    with pytest.raises(ts.TcpStoreProtocolError, match=match):
        codec.next_request()


@pytest.mark.parametrize("length", [2048, ts.MAX_KEY_BYTES])
def test_a_key_as_long_as_torchs_server_accepts_is_parsed(length: int) -> None:
    # torch's default (libuv) TCPStore server takes keys up to 8191 bytes (issue 30: a 2 KiB key was dropped).
    codec = _validated()
    key = "k" * length
    codec.receive_data(b"\x01" + struct.pack("<Q", length) + key.encode() + struct.pack("<Q", 1) + b"v")
    assert codec.next_request() == ts.Set(key, b"v")


def test_eof_inside_a_request_is_an_error_and_a_clean_eof_ends_the_connection() -> None:
    codec = _validated()
    codec.receive_data(bytes.fromhex("0302000000000000002f"))
    assert codec.next_request() is None
    codec.receive_data(b"")
    with pytest.raises(ts.TcpStoreProtocolError, match="closed inside a request"):
        codec.next_request()
    clean = _validated()
    clean.receive_data(b"")
    assert clean.next_request() is None and clean.closed
