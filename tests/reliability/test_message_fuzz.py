"""Fuzz every registered message model: hostile payloads decode to a valid message or `bad_payload`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodld.wire.errors import WireError
from flodld.wire.join import Hello, RankExited
from flodld.wire.messages import Message, decode_message, encode_message, registered_kinds

from .exemplars import EXEMPLARS

FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BY_KIND = {type(m).KIND: m for m in EXEMPLARS}
TEST_KINDS = range(0xFE00, 0xFF00)  # reserved for tests' own messages
ABSURD: list[Any] = [
    None, True, -1, -(2**63) - 1, 2**64, 10**6, 10**400, 1.5, -0.0, "", "x" * 100_000, "bad\x00nul",
    "\ud800", "line\nbreak", [], [0] * 10_000, ["cpu:0"] * 10_001, {}, {"nested": {"deep": [1]}},
]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


def _decode(kind: int, payload: bytes) -> Message | WireError:
    try:
        return decode_message(kind, payload)
    except WireError as error:
        assert error.code == "bad_payload", error
        assert len(str(error)) <= 1100
        return error


def test_every_registered_message_has_an_exemplar_that_round_trips() -> None:
    missing = sorted(hex(k) for k in registered_kinds() if k not in BY_KIND and k not in TEST_KINDS)
    assert not missing, f"add exemplars for kinds {missing} to tests/reliability/exemplars.py"
    for message in EXEMPLARS:
        kind, payload = encode_message(message)
        assert decode_message(kind, payload) == message


@pytest.mark.parametrize("kind", sorted(BY_KIND), ids=lambda k: type(BY_KIND[k]).__name__)
@FUZZ
@given(data=st.data())
def test_any_field_set_to_an_absurd_value_is_refused_naming_the_field_or_stays_within_caps(
    kind: int, data: st.DataObject
) -> None:
    original = json.loads(encode_message(BY_KIND[kind])[1])
    fields = [*sorted(type(BY_KIND[kind]).model_fields), "unexpected_field"]
    field = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(st.sampled_from(ABSURD) | JSON_VALUES, label="value")
    mutated = {**original, field: value}
    outcome = _decode(kind, json.dumps(mutated).encode("utf-8", "surrogatepass"))
    if isinstance(outcome, WireError):
        assert field in str(outcome) or "<message>" in str(outcome) or "Invalid JSON" in str(outcome)
    else:
        # Accepted: then it is exactly representable and re-encodes within the payload cap.
        again = decode_message(kind, encode_message(outcome)[1])
        assert again == outcome
        assert len(encode_message(outcome)[1]) < 4 * 2**20


@pytest.mark.parametrize("kind", sorted(registered_kinds()))
@settings(max_examples=6, deadline=None)
@given(payload=JSON_VALUES.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64))
def test_arbitrary_json_or_bytes_never_raise_anything_but_bad_payload(kind: int, payload: bytes) -> None:
    _decode(kind, payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xfe{}",
        b'{"host": "\xc3\x28"}',
        b"[" * 200_000,
        b'{"a":' * 50_000,
        b"1e999999",
        b"",
        b"null",
        b'{"rank": NaN, "code": 0}',
        b'{"rank": Infinity, "code": 0}',
    ],
    ids=["bom", "bad-utf8", "deep-list", "deep-object", "huge-exponent", "empty", "null", "nan", "infinity"],
)
def test_malformed_json_and_invalid_utf8_are_bad_payload(payload: bytes) -> None:
    for kind in (Hello.KIND, RankExited.KIND):
        assert isinstance(_decode(kind, payload), WireError)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"devices": [f"cpu:{i}" for i in range(10**6)]}, "devices"),
        ({"host": "h" * 100_000}, "host"),
        ({"host": "evil host"}, "host"),
        ({"protocol_version": -1}, "protocol_version"),
        ({"protocol_version": "1"}, "protocol_version"),
        ({"devices": ["cpu:0", "cpu:0"]}, "devices"),
        ({"dataset_sig": "zz" * 32}, "dataset_sig"),
    ],
    ids=[
        "million-devices",
        "huge-host",
        "space-host",
        "negative-version",
        "string-version",
        "dup-device",
        "bad-sig",
    ],
)
def test_absurd_hellos_are_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    good = json.loads(encode_message(BY_KIND[Hello.KIND])[1])
    outcome = _decode(Hello.KIND, json.dumps({**good, **change}).encode())
    assert isinstance(outcome, WireError) and field in str(outcome)


@pytest.mark.parametrize("rank", [-1, 2**31, 10**30])
def test_out_of_range_ranks_are_refused(rank: int) -> None:
    outcome = _decode(RankExited.KIND, json.dumps({"rank": rank, "code": 0}).encode())
    assert isinstance(outcome, WireError) and "rank" in str(outcome)
