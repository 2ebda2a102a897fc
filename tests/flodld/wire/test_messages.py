"""Message base, registry and codec: compact JSON, strict decoding, caps enforced at registration."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field

import flodld.wire.join  # noqa: F401  (registers the join kinds)
from flodld.wire.errors import WireError
from flodld.wire.messages import (
    KIND_RANGES,
    BoundedList,
    HexDigest,
    HostName,
    Message,
    Name,
    Reason,
    WireModel,
    decode_message,
    encode_message,
    message_class,
    register,
    registered_kinds,
    uncapped_fields,
)

TEST_KIND = 0xFE01


@register(TEST_KIND)
class Probe(Message):
    host: HostName
    names: BoundedList[Name] = Field(default_factory=list)
    note: Reason = ""
    digest: HexDigest | None = None
    weight: float = 1.0


def expect_bad_payload(payload: bytes, fragment: str = "") -> None:
    with pytest.raises(WireError) as caught:
        decode_message(TEST_KIND, payload)
    assert caught.value.code == "bad_payload"
    assert fragment in str(caught.value)


def test_encode_is_compact_json_and_decodes_to_an_equal_message() -> None:
    message = Probe(host="node-a", names=["x"], digest="AB" * 32)
    kind, payload = encode_message(message)
    assert kind == TEST_KIND
    assert b" " not in payload
    assert decode_message(kind, payload) == message
    assert message.digest == "ab" * 32  # normalised to lowercase


def test_unknown_kind() -> None:
    with pytest.raises(WireError) as caught:
        decode_message(0xFEFF, b"{}")
    assert caught.value.code == "unknown_kind" and "0xfeff" in str(caught.value)
    with pytest.raises(WireError):
        message_class(0xFEFF)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"not json", "Probe"),
        (b"[]", "Probe"),
        (b'{"host":"a","extra":1}', "extra"),
        (b'{"host":""}', "host"),
        (b'{"host":"has space"}', "whitespace"),
        (b'{"host":"a\\u0007"}', "host"),
        (b'{"host":5}', "host"),
        (b'{"host":"' + b"h" * 254 + b'"}', "host"),
        (b'{"host":"a","names":["n"' + b',"n"' * 4096 + b"]}", "names"),
        (b'{"host":"a","note":"' + b"r" * 1025 + b'"}', "note"),
        (b'{"host":"a","digest":"abc"}', "digest"),
        (b'{"host":"a","digest":"' + b"g" * 64 + b'"}', "digest"),
        (b'{"host":"a","weight":NaN}', "weight"),
        (b'{"host":"a","weight":"1.0"}', "weight"),
        (b'{"host":"a"', "Probe"),
        (b'\xff\xfe{"host":"a"}', "Probe"),
    ],
)
def test_invalid_payloads_are_bad_payload(payload: bytes, fragment: str) -> None:
    expect_bad_payload(payload, fragment)


def test_models_are_frozen() -> None:
    message = Probe(host="a")
    with pytest.raises(ValueError):
        message.host = "b"  # type: ignore[misc]  # the assignment is the point: a frozen model refuses it


def test_duplicate_kind_is_refused_with_both_names() -> None:
    with pytest.raises(ValueError, match="already registered to Probe"):

        @register(TEST_KIND)
        class Other(Message):
            value: int


def test_same_class_may_register_twice() -> None:
    assert register(TEST_KIND)(Probe) is Probe


@pytest.mark.parametrize("kind", [0, 0x10000, -1])
def test_kind_must_fit_u16(kind: int) -> None:
    with pytest.raises(ValueError, match=r"0x0001\.\.0xFFFF"):
        register(kind)


def test_uncapped_fields_are_refused_at_registration() -> None:
    with pytest.raises(TypeError, match=r"Loose.text, Loose.items, Loose.table"):

        @register(0xFE02)
        class Loose(Message):
            text: str
            items: list[int]
            table: Annotated[dict[Name, Name], Field(max_length=4)] | dict[str, int]
            fine: Annotated[list[Name], Field(max_length=3)]

    assert 0xFE02 not in registered_kinds()


def test_uncapped_items_inside_capped_containers_and_nested_models_are_found() -> None:
    class Inner(WireModel):
        label: str

    class Outer(WireModel):
        names: BoundedList[str]
        inner: Inner | None

    assert list(uncapped_fields(Outer)) == ["Outer.names[0]", "Outer.inner.label"]


def test_unregistered_messages_cannot_be_encoded() -> None:
    class Stray(Message):
        value: int

    with pytest.raises(ValueError, match="Stray is not registered"):
        encode_message(Stray(value=1))


def test_every_registered_message_is_capped_and_in_a_channel_range() -> None:
    ranges = [*KIND_RANGES.values(), range(0xFE00, 0xFF00)]  # 0xFExx: test-only kinds
    for kind, cls in registered_kinds().items():
        assert list(uncapped_fields(cls)) == []
        assert any(kind in span for span in ranges), (
            f"{cls.__qualname__} kind {kind:#06x} outside every range"
        )
