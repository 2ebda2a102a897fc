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

MAX_KEY_CHARS: Final = 1024
MAX_WAIT_SECS: Final = 7 * 24 * 3600.0

StoreKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_KEY_CHARS)]
"""A store key: 1..1024 characters (torch builds keys like '/default_pg/0//cpu//0')."""

WaitSecs = Annotated[float, Field(ge=0, le=MAX_WAIT_SECS)]
ValueLength = Annotated[int, Field(ge=0, lt=2**40)]


@register(0x0201)
class StoreHello(Message):
    """First frame on a store connection: names the run the rank belongs to."""

    run_id: Name
    rank: Annotated[int, Field(ge=-1, lt=2**31)] = -1


@register(0x0202)
class StoreSet(Message):
    """Set `key` to the frame tail."""

    key: StoreKey


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


@register(0x0205)
class StoreCompareSet(Message):
    """Tail = expected + desired; `expected_len` splits them. Reply StoreValue (the value now held)."""

    key: StoreKey
    expected_len: ValueLength


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


@register(0x020C)
class StoreAppend(Message):
    """Append the tail to `key` (absent = empty)."""

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
    """A request failed: `timeout`, `bad_request`, `too_large`, `wrong_run`, `not_integer`."""

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
    "StoreMultiGet",
    "StoreMultiSet",
    "StoreNumKeys",
    "StoreOk",
    "StoreSet",
    "StoreValue",
    "StoreValues",
    "StoreWait",
    "split_tail",
]
