"""Join-channel messages: kinds, round trips through frames, and the validators that guard admission."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.join import (
    Abort,
    Accept,
    Hello,
    KillRank,
    RankExited,
    Reform,
    Reject,
    RelaySpec,
    Stopped,
    WorldEnvelope,
    WorldFormed,
)
from flodld.wire.messages import Message, decode_message, encode_message
from tests.flodld.wire.conftest import connected_pair

SIG = "0123456789abcdef" * 4


def hello_fields(**overrides: object) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "host": "node-b",
        "devices": ["cuda:0", "cuda:1"],
        "device_labels": ["H200 (141GB)", "H200 (141GB)"],
        "variant": "precompiled/cu128",
        "torch_version": "2.13.0",
        "protocol_version": 1,
        "dataset_sig": SIG,
        "run_id": "run-42",
        "nccl_version": "2.27",
        "model_sig": None,
        "averaging": "sync",
    }
    fields.update(overrides)
    return fields


def envelope_fields(**overrides: object) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "run_id": "run-42",
        "world_size": 4,
        "ranks": [2, 3],
        "local_world_size": 2,
        "controller_host": "10.0.0.1",
        "controller_port": 1337,
        "averaging": "sync",
        "backend": "gloo",
        "env": {"OMP_NUM_THREADS": "1"},
    }
    fields.update(overrides)
    return fields


EXAMPLES: list[Message] = [
    Hello(**hello_fields()),
    Hello(
        **hello_fields(devices=["cpu:0"], device_labels=[], dataset_sig=None, run_id=None, nccl_version=None)
    ),
    Accept(ranks=[2, 3], salt_hex="ab" * 16, formation_wait_secs=12.5, run_id="run-42"),
    Accept(ranks=[0], salt_hex=None, formation_wait_secs=0.0, run_id="run-42"),
    Reject(code="duplicate_host", reason="host 'node-b' is already in the run"),
    WorldFormed(
        envelope=WorldEnvelope(**envelope_fields()),
        relay=RelaySpec(data_port=1341, control_port=1342, fold="sum_f32", cadence=1),
    ),
    WorldFormed(envelope=WorldEnvelope(**envelope_fields(ranks=[0], local_world_size=1, env={})), relay=None),
    RankExited(rank=3, code=0),
    RankExited(rank=3, code=-9),
    RankExited(
        rank=1, code=1, failed_at=1.5e9, torn_down=True, error="RuntimeError: x", tail="Traceback\nError: x"
    ),
    Abort(reason="quorum not met: 1 of 2 ranks after 300s"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_every_join_message_round_trips_through_a_frame(message: Message) -> None:
    dialer, listener = connected_pair()
    listener.receive_data(dialer.send_message(message))
    frame = listener.next_event()
    assert isinstance(frame, Frame)
    assert frame.message() == message


def test_join_kinds_are_pinned() -> None:
    classes = (Hello, Accept, Reject, WorldFormed, RankExited, Abort, KillRank, Reform, Stopped)
    kinds = {cls.__name__: cls.KIND for cls in classes}
    assert kinds == {
        "Hello": 0x0101, "Accept": 0x0102, "Reject": 0x0103,
        "WorldFormed": 0x0104, "RankExited": 0x0105, "Abort": 0x0106, "KillRank": 0x0107,
        "Reform": 0x0108, "Stopped": 0x0109,
    }  # fmt: skip


def decode_expecting_bad_payload(message_type: type[Message], fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(WireError) as caught:
        decode_message(message_type.KIND, json.dumps(fields).encode())
    assert caught.value.code == "bad_payload"
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"host": ""}, "host"),
        ({"host": "node b"}, "host"),
        ({"host": "x" * 254}, "host"),
        ({"devices": ["gpu0"]}, "devices"),
        ({"devices": ["cuda:0", "cuda:0"], "device_labels": []}, "twice"),
        ({"device_labels": ["only one"]}, "one label per device"),
        ({"dataset_sig": "abc"}, "dataset_sig"),
        ({"model_sig": "z" * 64}, "model_sig"),
        ({"nccl_version": "two"}, "nccl_version"),
        ({"protocol_version": -1}, "protocol_version"),
        ({"protocol_version": "1"}, "protocol_version"),
        ({"devices": ["cpu:0"] * 4097}, "devices"),
    ],
)
def test_invalid_hello_is_bad_payload(overrides: dict[str, Any], fragment: str) -> None:
    decode_expecting_bad_payload(Hello, hello_fields(**overrides), fragment)


def test_hello_without_required_fields_is_bad_payload() -> None:
    fields = hello_fields()
    del fields["host"]
    decode_expecting_bad_payload(Hello, fields, "host")


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"ranks": [-1], "formation_wait_secs": 1.0, "run_id": "r"}, "ranks"),
        ({"ranks": [1, 1], "formation_wait_secs": 1.0, "run_id": "r"}, "twice"),
        ({"ranks": [0], "salt_hex": "abc", "formation_wait_secs": 1.0, "run_id": "r"}, "32 hex"),
        ({"ranks": [0], "salt_hex": "zz" * 16, "formation_wait_secs": 1.0, "run_id": "r"}, "non-hex"),
        ({"ranks": [0], "formation_wait_secs": -1.0, "run_id": "r"}, "formation_wait_secs"),
    ],
)
def test_invalid_accept_is_bad_payload(fields: dict[str, Any], fragment: str) -> None:
    decode_expecting_bad_payload(Accept, fields, fragment)


def test_accept_normalises_the_salt_to_lowercase() -> None:
    assert (
        Accept(ranks=[0], salt_hex=" " + "AB" * 16 + "\n", formation_wait_secs=1.0, run_id="r").salt_hex
        == "ab" * 16
    )


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [({"code": "Not Snake", "reason": "x"}, "code"), ({"code": "ok", "reason": "r" * 1025}, "reason")],
)
def test_invalid_reject_is_bad_payload(fields: dict[str, Any], fragment: str) -> None:
    decode_expecting_bad_payload(Reject, fields, fragment)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"ranks": []}, "empty"),
        ({"ranks": [3, 2]}, "contiguous"),
        ({"ranks": [1, 3], "local_world_size": 2}, "contiguous"),
        ({"ranks": [3, 4]}, "does not fit"),
        ({"local_world_size": 1}, "local_world_size"),
        ({"hosts": ["a", "b"]}, "hosts"),  # join protocol 2: no host list in the envelope
        ({"controller_port": 0}, "controller_port"),
        ({"controller_port": 65536}, "controller_port"),
        ({"world_size": 0}, "world_size"),
        ({"env": {"BAD NAME": "x"}}, "env"),
        ({"env": {"A": "nul\u0000"}}, "NUL"),
    ],
)
def test_invalid_world_envelope_is_bad_payload(overrides: dict[str, Any], fragment: str) -> None:
    decode_expecting_bad_payload(
        WorldFormed, {"envelope": envelope_fields(**overrides), "relay": None}, fragment
    )


def test_invalid_relay_spec_is_bad_payload() -> None:
    relay = {"data_port": 1341, "control_port": 1342, "fold": "sum", "cadence": 0}
    decode_expecting_bad_payload(WorldFormed, {"envelope": envelope_fields(), "relay": relay}, "cadence")


@pytest.mark.parametrize(
    ("fields", "fragment"), [({"rank": -1, "code": 0}, "rank"), ({"rank": 0, "code": 256}, "code")]
)
def test_invalid_rank_exited_is_bad_payload(fields: dict[str, Any], fragment: str) -> None:
    decode_expecting_bad_payload(RankExited, fields, fragment)


def test_constructing_an_invalid_message_names_the_field() -> None:
    with pytest.raises(ValidationError, match="host"):
        Hello(**hello_fields(host=""))


def test_encoded_hello_is_json_with_the_contract_field_names() -> None:
    _kind, payload = encode_message(Hello(**hello_fields()))
    assert set(json.loads(payload)) == {
        "host", "devices", "device_labels", "variant", "torch_version", "protocol_version",
        "dataset_sig", "run_id", "nccl_version", "model_sig", "averaging", "rides",
    }  # fmt: skip


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
NEVER_VALID = [{"unexpected": 1}, [[{}]], True]


@settings(max_examples=80, deadline=None)
@given(message=st.sampled_from(EXAMPLES), data=st.data())
def test_any_field_replaced_by_a_wrong_type_is_bad_payload(message: Message, data: st.DataObject) -> None:
    fields = message.model_dump(mode="json")
    name = data.draw(st.sampled_from(sorted(fields)), label="field")
    # A boolean field (RankExited.torn_down) takes True: every other never-valid value still fails it.
    wrong = [value for value in NEVER_VALID if not (isinstance(fields[name], bool) and value is True)]
    fields[name] = data.draw(st.sampled_from(wrong), label="value")
    decode_expecting_bad_payload(type(message), fields, name)


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from([cls.KIND for cls in (Hello, Accept, Reject, WorldFormed, RankExited, Abort)]),
    value=json_values,
)
def test_arbitrary_json_decodes_or_is_bad_payload(kind: int, value: object) -> None:
    payload = json.dumps(value).encode()
    try:
        message = decode_message(kind, payload)
    except WireError as error:
        assert error.code == "bad_payload"
    else:
        assert decode_message(*encode_message(message)) == message


def test_only_a_healed_slot_of_a_host_may_ask_to_ride_its_relay() -> None:
    """Hello.rides (docs/elastic-averaging.md, "Slots heal in place"): `a+1` may ask to ride a's relay; a host
    that is not one of a's healed slots is refused at decode, naming the rule.
    """
    assert Hello(**hello_fields(host="a+1", rides="a")).rides == "a"
    for host in ("b", "ab+1", "a"):
        with pytest.raises(ValidationError, match="only a healed slot of that host"):
            Hello(**hello_fields(host=host, rides="a"))
