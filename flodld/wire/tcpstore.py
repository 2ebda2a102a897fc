"""torch's TCPStore client protocol, server side, sans-io: bytes in → requests out; replies → bytes.

What a stock `init_process_group()` (env://) speaks to MASTER_ADDR:MASTER_PORT. The agent serves it
on 127.0.0.1 (`flodld.agent.tcpstore`) and answers from the controller's authenticated store, so
nothing of this protocol (which has no authentication at all) ever leaves the host.

The protocol, as torch 2.13's TCPStore client sends it (recorded bytes in tests/flodld/wire/test_tcpstore.py;
the query types only grew at the end of torch's enum since VALIDATE became 0, so older clients in the
supported range send a subset; re-record when a torch version is added): every request is one query-type
byte followed by its arguments; integers are 8 bytes little-endian (the machine's order: x86-64 and aarch64
are little); a string or a byte value is a u64 length and the bytes; a key list is a u64 count and the
strings.

| byte | request | arguments | reply |
|---|---|---|---|
| 0 | VALIDATE | u32 magic 0x3C85F7CE | none (a wrong magic closes the connection) |
| 1 | SET | key, value | none |
| 2 | COMPARE_SET | key, expected, desired | value |
| 3 | GET | key (the client WAITs first) | value |
| 4 | ADD | key, i64 | i64 |
| 5 | CHECK | keys | u8: 0 ready, 1 not ready |
| 6 | WAIT | keys | u8 0 (stop waiting), when every key exists |
| 7 | GETNUMKEYS | — | i64 |
| 8 | DELETE_KEY | key | i64: 1 deleted, 0 absent |
| 9 | APPEND | key, value | none |
| 10 | MULTI_GET | keys (the client WAITs first) | one value per key |
| 11 | MULTI_SET | u64 count, then key, value pairs | none |
| 12 | CANCEL_WAIT | — | u8 1 (wait canceled), after the pending WAIT's answer if any |
| 13 | PING | u32 nonce | u32 nonce |
| 14 | QUEUE_PUSH | key, value | none |
| 15 | QUEUE_POP | key (a blocking pop WAITs first) | i64 1 then value, or i64 0 when empty |
| 16 | QUEUE_LEN | key | i64 |
| 17 | LIST_KEYS | — | i64 count, then the keys |

The first request must be VALIDATE with the magic: a peer that is not a torch TCPStore client (a web
page posting to the loopback port, a stray scanner) is refused on its first byte. Every length and count
is capped before anything is allocated; a violation raises `TcpStoreProtocolError`, and the caller drops
the connection.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeVar

VALIDATION_MAGIC: Final = 0x3C85F7CE
MAX_KEY_BYTES: Final = 8 * 1024 - 1
"""A key's cap: the longest key torch's default (libuv) TCPStore server accepts, which drops the
connection on a key of 8 KiB or more (the controller store's StoreKey has the same cap, in characters)."""
MAX_VALUE_BYTES: Final = 64 * 1024 * 1024
"""One value's cap, as the controller store's."""
MAX_KEYS: Final = 4096
"""Keys in one CHECK/WAIT/MULTI_GET/MULTI_SET (the controller store's list bound)."""
MAX_KEY_LIST_BYTES: Final = 8 * 1024 * 1024
"""The keys of one request in all (4096 keys of 2 KiB): what the agent forwards stays inside one frame's
16 MiB payload."""
MAX_REQUEST_BYTES: Final = MAX_VALUE_BYTES + MAX_KEY_LIST_BYTES + 2 * MAX_KEYS * 16
"""Bytes one request may hold in all (values, keys and their lengths); a MULTI_SET over this is refused."""

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")


class QueryType(IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17


class TcpStoreProtocolError(ValueError):
    """The peer broke the protocol (or a cap); drop the connection. The message says how."""


# --- requests --------------------------------------------------------------------------------
#
# Each request class is registered with the query type it answers and what reads its arguments
# (`@_reads`); the requests that carry the same arguments share the base that declares them. `_parse`
# looks the query byte up in `_READERS`.

class _Incomplete(Exception):
    """More bytes are needed (internal to the parser)."""


class _Reader:
    """Reads one request from the front of a buffer; raises _Incomplete when the buffer ends early."""

    def __init__(self, buffer: bytearray) -> None:
        self.buffer = buffer
        self.offset = 0
        self.key_bytes = 0  # the request's keys so far, against MAX_KEY_LIST_BYTES

    def take(self, count: int) -> bytes:
        end = self.offset + count
        if end > len(self.buffer):
            raise _Incomplete
        piece = bytes(self.buffer[self.offset : end])
        self.offset = end
        return piece

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self.take(8))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def value(self) -> bytes:
        length = self.u64()
        if length > MAX_VALUE_BYTES:
            raise TcpStoreProtocolError(f"a value of {length} bytes is over the {MAX_VALUE_BYTES}-byte cap")
        if self.offset + length > MAX_REQUEST_BYTES:
            raise TcpStoreProtocolError(f"a request over {MAX_REQUEST_BYTES} bytes")
        return self.take(length)

    def key(self) -> str:
        length = self.u64()
        if length > MAX_KEY_BYTES:
            raise TcpStoreProtocolError(f"a key of {length} bytes is over the {MAX_KEY_BYTES}-byte cap")
        if length == 0:
            raise TcpStoreProtocolError("an empty key")
        self.key_bytes += length
        if self.key_bytes > MAX_KEY_LIST_BYTES:
            raise TcpStoreProtocolError(f"keys over {MAX_KEY_LIST_BYTES} bytes in one request")
        raw = self.take(length)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise TcpStoreProtocolError("a key that is not UTF-8") from None

    def count(self) -> int:
        count = self.u64()
        if count > MAX_KEYS:
            raise TcpStoreProtocolError(f"{count} keys in one request, over the cap of {MAX_KEYS}")
        return count

    def keys(self) -> tuple[str, ...]:
        return tuple(self.key() for _ in range(self.count()))

    def key_values(self) -> list[tuple[str, bytes]]:
        return [(self.key(), self.value()) for _ in range(self.count())]


_READERS: Final[dict[QueryType, Callable[[_Reader], Request]]] = {}
"""What reads each query type's arguments into its request; filled by `@_reads` below."""

_R = TypeVar("_R", bound="Request")


def _reads(query: QueryType, read: Callable[[_Reader], _R]) -> Callable[[type[_R]], type[_R]]:
    """Class decorator: `read` reads `query`'s arguments into the decorated request class."""

    def register(kind: type[_R]) -> type[_R]:
        _READERS[query] = read
        return kind

    return register


@dataclass(frozen=True)
class _KeyValueRequest:
    """A request whose arguments are a key and a value."""

    key: str
    value: bytes


@_reads(QueryType.SET, lambda r: Set(r.key(), r.value()))
class Set(_KeyValueRequest):
    """SET: store `value` under `key`."""


@dataclass(frozen=True)
class _KeyRequest:
    """A request whose one argument is a key."""

    key: str


@_reads(QueryType.VALIDATE, lambda r: Validate(r.u32()))
@dataclass(frozen=True)
class Validate:
    """VALIDATE: the first request of a connection; `magic` must be VALIDATION_MAGIC."""

    magic: int


@_reads(QueryType.COMPARE_SET, lambda r: CompareSet(r.key(), r.value(), r.value()))
@dataclass(frozen=True)
class CompareSet:
    """COMPARE_SET: `desired` under `key` if its value is `expected`; the reply is the value it then holds."""

    key: str
    expected: bytes
    desired: bytes


@_reads(QueryType.GET, lambda r: Get(r.key()))
class Get(_KeyRequest):
    """GET: the value of `key` (the client WAITs for it first)."""


@dataclass(frozen=True)
class _KeysRequest:
    """A request whose one argument is a key list."""

    keys: tuple[str, ...]


@_reads(QueryType.ADD, lambda r: Add(r.key(), r.i64()))
@dataclass(frozen=True)
class Add:
    """ADD: add `amount` to the integer under `key` (an absent key counts as 0)."""

    key: str
    amount: int


@_reads(QueryType.CHECK, lambda r: Check(r.keys()))
class Check(_KeysRequest):
    """CHECK: whether every key exists."""


@_reads(QueryType.WAIT, lambda r: Wait(r.keys()))
class Wait(_KeysRequest):
    """WAIT: answered when every key exists (or the wait is canceled)."""


@dataclass(frozen=True)
class _BareRequest:
    """A request with no arguments."""


@_reads(QueryType.GETNUMKEYS, lambda r: NumKeys())
class NumKeys(_BareRequest):
    """GETNUMKEYS: how many keys the store holds."""


@_reads(QueryType.DELETE_KEY, lambda r: DeleteKey(r.key()))
class DeleteKey(_KeyRequest):
    """DELETE_KEY: remove `key`; the reply says whether it was there."""


@_reads(QueryType.APPEND, lambda r: Append(r.key(), r.value()))
class Append(_KeyValueRequest):
    """APPEND: add `value` to the end of `key`'s value (an absent key starts empty)."""


@_reads(QueryType.MULTI_GET, lambda r: MultiGet(r.keys()))
class MultiGet(_KeysRequest):
    """MULTI_GET: the values of several keys (the client WAITs for them first)."""


@_reads(QueryType.MULTI_SET, lambda r: MultiSet.of(r.key_values()))
@dataclass(frozen=True)
class MultiSet:
    """MULTI_SET: store each value under the key at its position."""

    keys: tuple[str, ...]
    values: tuple[bytes, ...]

    @classmethod
    def of(cls, pairs: list[tuple[str, bytes]]) -> MultiSet:
        """From (key, value) pairs, as the wire lists them."""
        return cls(tuple(key for key, _ in pairs), tuple(value for _, value in pairs))


@_reads(QueryType.CANCEL_WAIT, lambda r: CancelWait())
class CancelWait(_BareRequest):
    """CANCEL_WAIT: give up the pending WAIT."""


@_reads(QueryType.PING, lambda r: Ping(r.u32()))
@dataclass(frozen=True)
class Ping:
    """PING: the reply echoes `nonce`."""

    nonce: int


@_reads(QueryType.QUEUE_PUSH, lambda r: QueuePush(r.key(), r.value()))
class QueuePush(_KeyValueRequest):
    """QUEUE_PUSH: add `value` to the back of the queue under `key`."""


@_reads(QueryType.QUEUE_POP, lambda r: QueuePop(r.key()))
class QueuePop(_KeyRequest):
    """QUEUE_POP: take the front of the queue under `key` (a blocking pop WAITs first)."""


@_reads(QueryType.QUEUE_LEN, lambda r: QueueLen(r.key()))
class QueueLen(_KeyRequest):
    """QUEUE_LEN: how many values the queue under `key` holds."""


@_reads(QueryType.LIST_KEYS, lambda r: ListKeys())
class ListKeys(_BareRequest):
    """LIST_KEYS: every key the store holds."""


Request = (
    Validate
    | Ping
    | Set
    | CompareSet
    | Get
    | Add
    | Check
    | Wait
    | NumKeys
    | DeleteKey
    | Append
    | MultiGet
    | MultiSet
    | CancelWait
    | QueuePush
    | QueuePop
    | QueueLen
    | ListKeys
)
"""One decoded request. Replies are the caller's to build with the `reply_*` functions below."""
assert len(_READERS) == len(QueryType), "every query type has its reader"

def _parse(reader: _Reader) -> Request:
    code = reader.take(1)[0]
    try:
        query = QueryType(code)
    except ValueError:
        raise TcpStoreProtocolError(f"unknown query type {code}") from None
    return _READERS[query](reader)


class TcpStoreServerConnection:
    """The server end of one TCPStore client connection: feed bytes, take requests in order.

    `receive_data(b"")` marks the peer's EOF. `next_request()` returns the next complete request, or None
    when more bytes are needed (or, after EOF, when the connection is over: see `closed`). The first
    request must be a VALIDATE carrying the magic; anything else raises TcpStoreProtocolError.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._validated = False
        self._eof = False
        self.closed = False

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        if self._eof:
            raise TcpStoreProtocolError("data after EOF")
        self._buffer += data

    def next_request(self) -> Request | None:
        if self.closed:
            return None
        reader = _Reader(self._buffer)
        try:
            request = _parse(reader)
        except _Incomplete:
            if self._eof:
                self.closed = True
                if self._buffer:
                    raise TcpStoreProtocolError(
                        f"connection closed inside a request ({len(self._buffer)} bytes)"
                    ) from None
            return None
        del self._buffer[: reader.offset]
        if not self._validated:
            if not isinstance(request, Validate):
                raise TcpStoreProtocolError(
                    f"the first request must be VALIDATE, got {type(request).__name__}"
                )
            if request.magic != VALIDATION_MAGIC:
                raise TcpStoreProtocolError(f"VALIDATE with a wrong magic 0x{request.magic:08x}")
            self._validated = True
        elif isinstance(request, Validate):
            raise TcpStoreProtocolError("VALIDATE sent twice")
        return request


# --- replies ---------------------------------------------------------------------------------

CHECK_READY: Final = 0
CHECK_NOT_READY: Final = 1
WAIT_STOP_WAITING: Final = 0
WAIT_CANCELED: Final = 1


def reply_value(value: bytes) -> bytes:
    """GET, COMPARE_SET: the value, length first."""
    return _U64.pack(len(value)) + value


def reply_values(values: list[bytes]) -> bytes:
    """MULTI_GET: each value, in the order of the keys asked for."""
    return b"".join(reply_value(value) for value in values)


def reply_int(value: int) -> bytes:
    """ADD, GETNUMKEYS, QUEUE_LEN."""
    return _I64.pack(value)


def reply_deleted(deleted: bool) -> bytes:
    """DELETE_KEY: how many keys were deleted (1 or 0)."""
    return _I64.pack(1 if deleted else 0)


def reply_check(ready: bool) -> bytes:
    return bytes([CHECK_READY if ready else CHECK_NOT_READY])


def reply_stop_waiting() -> bytes:
    """WAIT: every key exists now."""
    return bytes([WAIT_STOP_WAITING])


def reply_wait_canceled() -> bytes:
    """CANCEL_WAIT: the pending wait (if any) is gone."""
    return bytes([WAIT_CANCELED])


def reply_ping(nonce: int) -> bytes:
    return _U32.pack(nonce)


def reply_queue_pop(value: bytes | None) -> bytes:
    """QUEUE_POP: 1 and the value, or 0 when the queue was empty."""
    return _I64.pack(0) if value is None else _I64.pack(1) + reply_value(value)


def reply_keys(keys: list[str]) -> bytes:
    """LIST_KEYS: the count, then every key."""
    return _I64.pack(len(keys)) + b"".join(reply_value(key.encode()) for key in keys)


__all__ = [
    "MAX_KEYS",
    "MAX_KEY_BYTES",
    "MAX_KEY_LIST_BYTES",
    "MAX_VALUE_BYTES",
    "VALIDATION_MAGIC",
    "Add",
    "Append",
    "CancelWait",
    "Check",
    "CompareSet",
    "DeleteKey",
    "Get",
    "ListKeys",
    "MultiGet",
    "MultiSet",
    "NumKeys",
    "Ping",
    "QueryType",
    "QueueLen",
    "QueuePop",
    "QueuePush",
    "Request",
    "Set",
    "TcpStoreProtocolError",
    "TcpStoreServerConnection",
    "Validate",
    "Wait",
    "reply_check",
    "reply_deleted",
    "reply_int",
    "reply_keys",
    "reply_ping",
    "reply_queue_pop",
    "reply_stop_waiting",
    "reply_value",
    "reply_values",
    "reply_wait_canceled",
]
