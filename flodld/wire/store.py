"""Rendezvous key/value store messages (kinds 0x02xx), the protocol behind `ControllerStore`.

One request, one reply, in order, on a rendezvous-channel connection keyed with the session
salt. Values travel as the frame's raw tail, never inside the JSON payload, so bytes stay bytes.
Several values (multi_get/multi_set, compare_set) are concatenated in the tail with their
lengths listed in the payload; the receiver checks the lengths sum to the tail length.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field, StringConstraints

from flodld.wire.messages import BoundedList, Message, Name, Reason, ReasonCode, register

MAX_KEY_CHARS: Final = 8 * 1024 - 1
MAX_WAIT_SECS: Final = 7 * 24 * 3600.0
MAX_VALUE_BYTES: Final = 64 * 1024 * 1024
"""The cap on one stored value, on a request's tail and on a reply's tail (a multi_get answers at most
this much in total; more gets StoreError(too_large))."""

StoreKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_KEY_CHARS)]
"""A store key: 1..8191 characters (torch builds keys like '/default_pg/0//cpu//0'; its default TCPStore
server takes keys of up to 8191 bytes, and a PrefixStore's prefixes make keys long)."""

WaitSecs = Annotated[float, Field(ge=0, le=MAX_WAIT_SECS)]
ValueLength = Annotated[int, Field(ge=0, lt=2**40)]
RequestId = Annotated[int, Field(ge=0, lt=2**63)]
"""Names one mutating request of one client (`StoreHello.client_id`), counting up from 1; 0 = not
deduplicated. A request re-sent after a lost reply carries the same id, and the controller answers it
from its record instead of applying it twice."""
ClientId = Annotated[str, StringConstraints(max_length=32, pattern=r"^([0-9a-f]{32})?$")]


@register(0x0201)
class StoreHello(Message):
    """First frame on a store connection: names the run the rank belongs to."""

    run_id: Name
    rank: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    client_id: ClientId = ""
    """128 random bits, hex: the client whose `request_id`s the controller deduplicates (empty = none).
    Stays the same across the client's re-dials; each clone of a store has its own."""


@register(0x0202)
class StoreSet(Message):
    """Set `key` to the frame tail."""

    key: StoreKey
    request_id: RequestId = 0


@register(0x0203)
class StoreGet(Message):
    """Wait up to `timeout` for `key`, then reply StoreValue (tail = value)."""

    key: StoreKey
    timeout: WaitSecs


@register(0x0204)
class StoreAdd(Message):
    """Add `amount` to the decimal integer at `key` (absent = 0); reply StoreInt."""

    key: StoreKey
    amount: Annotated[int, Field(ge=-(2**63), lt=2**63)]
    request_id: RequestId = 0


@register(0x0205)
class StoreCompareSet(Message):
    """Tail = expected + desired; `expected_len` splits them. Reply StoreValue (the value now held)."""

    key: StoreKey
    expected_len: ValueLength
    request_id: RequestId = 0


@register(0x0206)
class StoreWait(Message):
    """Wait up to `timeout` until every key exists; reply StoreOk or StoreError(timeout)."""

    keys: BoundedList[StoreKey]
    timeout: WaitSecs


@register(0x0207)
class StoreCheck(Message):
    """Reply StoreBool: do all keys exist now."""

    keys: BoundedList[StoreKey]


@register(0x0208)
class StoreDeleteKey(Message):
    """Reply StoreBool: whether the key existed."""

    key: StoreKey
    request_id: RequestId = 0


@register(0x0209)
class StoreNumKeys(Message):
    """Reply StoreInt: how many keys the run's store holds."""


@register(0x020A)
class StoreMultiGet(Message):
    """Wait up to `timeout` for all keys; reply StoreValues."""

    keys: BoundedList[StoreKey]
    timeout: WaitSecs


@register(0x020B)
class StoreMultiSet(Message):
    """Tail = values concatenated in key order, `lengths` splits them."""

    keys: BoundedList[StoreKey]
    lengths: BoundedList[ValueLength]
    request_id: RequestId = 0


@register(0x020C)
class StoreAppend(Message):
    """Append the tail to `key` (absent = empty)."""

    key: StoreKey
    request_id: RequestId = 0


@register(0x020D)
class StoreListKeys(Message):
    """Reply StoreValues: every key (UTF-8), in insertion order; too_large when they exceed the reply cap."""


@register(0x020E)
class StoreQueuePush(Message):
    """Push the tail onto the FIFO queue `key` (queues and plain keys are separate; `check`/`wait` see a
    non-empty queue as present).
    """

    key: StoreKey
    request_id: RequestId = 0


@register(0x020F)
class StoreQueuePop(Message):
    """Wait up to `timeout` (0 = do not wait) for queue `key` to be non-empty, pop its head: StoreValue,
    or StoreError(queue_empty) when it stayed empty (timeout > 0: StoreError(timeout)).
    """

    key: StoreKey
    timeout: WaitSecs
    request_id: RequestId = 0


@register(0x0210)
class StoreQueueLen(Message):
    """Reply StoreInt: the length of queue `key` (0 when absent)."""

    key: StoreKey


@register(0x0281)
class StoreOk(Message):
    """Generic success reply."""


@register(0x0282)
class StoreValue(Message):
    """One value, carried in the tail."""


@register(0x0283)
class StoreValues(Message):
    """Several values concatenated in the tail, split by `lengths`."""

    lengths: BoundedList[ValueLength]


@register(0x0284)
class StoreInt(Message):
    value: Annotated[int, Field(ge=-(2**63), lt=2**63)]


@register(0x0285)
class StoreBool(Message):
    value: bool


@register(0x0286)
class StoreError(Message):
    """A request failed: `timeout`, `bad_request`, `too_large` (a value, or a whole reply, over the cap),
    `duplicate_key` (multi_get naming a key twice), `wrong_run`, `not_integer`, `queue_empty`,
    `stale_request` (a request id older than the client's last).
    """

    code: ReasonCode
    reason: Reason


def split_tail(tail: bytes, lengths: list[int]) -> list[bytes]:
    """Cut `tail` into pieces of `lengths`; ValueError when they do not add up to the tail."""
    if sum(lengths) != len(tail):
        raise ValueError(f"value lengths add up to {sum(lengths)} bytes but the frame carries {len(tail)}")
    pieces, offset = [], 0
    for length in lengths:
        pieces.append(tail[offset : offset + length])
        offset += length
    return pieces


__all__ = [
    "MAX_KEY_CHARS",
    "MAX_VALUE_BYTES",
    "StoreAdd",
    "StoreAppend",
    "StoreBool",
    "StoreCheck",
    "StoreCompareSet",
    "StoreDeleteKey",
    "StoreError",
    "StoreGet",
    "StoreHello",
    "StoreInt",
    "StoreListKeys",
    "StoreMultiGet",
    "StoreMultiSet",
    "StoreNumKeys",
    "StoreOk",
    "StoreQueueLen",
    "StoreQueuePop",
    "StoreQueuePush",
    "StoreSet",
    "StoreValue",
    "StoreValues",
    "StoreWait",
    "split_tail",
]
