"""Transfer descriptors in one process: describe, validate, allocate, rebuild."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fhelium_dist_values import (
    ciphertext,
    compressed_sparse,
    keys,
    plaintext_rns,
    plaintext_slots,
    secret_key,
)

from fhelium.distributed._transfer import (
    MAX_RECEIVE_BYTES,
    MAX_TRANSFER_BYTES,
    TRANSFER_PROTOCOL_VERSION,
    DescriptorError,
    TensorDescriptor,
    ValueDescriptor,
    allocate_value,
    check_receive_total,
    decode_descriptor,
    describe_value,
    encode_descriptor,
    payload_leaves,
)
from fhelium.serialization.value import VALUE_SCHEMA_VERSION, ValueEnvelope

CPU = torch.device("cpu")


def _wire(value: object) -> dict[str, Any]:
    """The descriptor as a peer would receive it (through JSON)."""
    wire: dict[str, Any] = json.loads(json.dumps(encode_descriptor(describe_value(value))))
    return wire


def _returning(value: object) -> Callable[[], object]:
    """A factory that hands back `value` itself, the same object on every call."""
    return lambda: value


VALUES: dict[str, Callable[[], object]] = {
    "batched-ciphertext": lambda: ciphertext(batch=(2, 3), prime_ids=(2, 3, 4), depth=2),
    "slots-plaintext": plaintext_slots,
    "rns-plaintext": plaintext_rns,
    "sparse-compressed-plaintext": compressed_sparse,
    "secret-key": secret_key,
    **{f"key-{type(k).__name__}": _returning(k) for k in keys()},
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_descriptor_allocates_exact_receive_state(name: str) -> None:
    value = VALUES[name]()
    descriptor = decode_descriptor(_wire(value))
    received, leaves = allocate_value(descriptor, CPU)
    assert type(received) is type(value)
    sent, got = ValueEnvelope.from_value(value), ValueEnvelope.from_value(received)
    assert got.metadata == sent.metadata
    assert list(got.tensors) == list(sent.tensors)
    for tensor_name, tensor in sent.tensors.items():
        assert got.tensors[tensor_name].shape == tensor.shape
        assert got.tensors[tensor_name].dtype == tensor.dtype
        assert got.tensors[tensor_name].device == CPU
        assert got.tensors[tensor_name].is_contiguous()
    assert [leaf.data_ptr() for leaf in leaves] == [t.data_ptr() for t in got.tensors.values()]


def test_descriptor_carries_protocol_and_schema_versions_independently() -> None:
    value = ciphertext(depth=2)
    wire = _wire(value)
    assert wire["protocol_version"] == TRANSFER_PROTOCOL_VERSION
    assert wire["value_schema_version"] == VALUE_SCHEMA_VERSION
    assert wire["kind"] == "fhelium_value" and wire["value_type"] == "Ciphertext"
    assert wire["metadata"] == ValueEnvelope.from_value(value).metadata
    assert "context_id" not in wire and "depth" not in wire
    assert wire["tensors"] == [{"name": "data", "shape": [2, 3, 16], "dtype": "int64", "device_type": "cpu"}]


def test_raw_tensor_has_its_own_descriptor_kind() -> None:
    tensor = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()
    descriptor = decode_descriptor(_wire(tensor))
    assert isinstance(descriptor, TensorDescriptor)
    assert encode_descriptor(descriptor) == {
        "protocol_version": TRANSFER_PROTOCOL_VERSION,
        "kind": "tensor",
        "tensor": {"shape": [3, 2], "dtype": "float64", "device_type": "cpu"},
    }
    received, _ = allocate_value(descriptor, CPU)
    assert received.shape == (3, 2) and received.dtype == torch.float64 and received.is_contiguous()
    assert payload_leaves(tensor) == (tensor,)


def _tampered(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    wire = _wire(ciphertext())
    change(wire)
    return wire


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w: w.update(protocol_version=TRANSFER_PROTOCOL_VERSION + 1), "unsupported transfer protocol"),
        (lambda w: w.update(protocol_version=True), "unsupported transfer protocol"),
        (lambda w: w.update(kind="pickle"), "unknown transfer descriptor kind"),
        (lambda w: w.update(extra=1), "Extra inputs"),
        (lambda w: w.pop("metadata"), "metadata"),
        (lambda w: w["metadata"].update(prime_ids=[2, 2, 4]), "strictly increasing"),
        (lambda w: w["metadata"].update(scale=-1.0), "scale"),
        (lambda w: w["metadata"].update(level=3), "unexpected fields"),
        (lambda w: w.update(value_schema_version=VALUE_SCHEMA_VERSION + 7), "schema version"),
        (lambda w: w.update(value_type="Ciphertext2"), "value_type"),
        (lambda w: w["tensors"][0].update(name="payload"), "tensor names"),
        (lambda w: w["tensors"][0].update(dtype="object"), "dtype"),
        (lambda w: w["tensors"][0].update(dtype="float32"), "int64 or int32"),
        (lambda w: w["tensors"][0].update(device_type="mps"), "device_type"),
        (lambda w: w["tensors"][0].update(shape=[2, 4, 16]), "limb axis"),
        (lambda w: w["tensors"][0].update(shape=[2, -3, 16]), "greater than or equal"),
        (lambda w: w["tensors"][0].update(shape=[2, 3, 2**40]), "cap"),
    ],
)
def test_bad_descriptors_are_refused_before_allocation(
    change: Callable[[dict[str, Any]], object], message: str
) -> None:
    with pytest.raises(DescriptorError, match=message):
        decode_descriptor(_tampered(change))


@pytest.mark.parametrize(
    "shape",
    [
        [0] + [2**40 - 1] * 7,  # issue 13 point 10: zero elements, strides overflow int64
        [0, 2**32, 2**31],
        [2**20, 0, 2**20, 2**20],
    ],
)
def test_zero_element_tensors_with_huge_extents_are_a_descriptor_error(shape: list[int]) -> None:
    """No bytes to receive, but torch.empty would raise 'Stride calculation overflowed'."""
    raw = {
        "protocol_version": TRANSFER_PROTOCOL_VERSION,
        "kind": "tensor",
        "tensor": {"shape": shape, "dtype": "int64", "device_type": "cpu"},
    }
    with pytest.raises(DescriptorError, match=r"spans over the \d+-byte cap \(zero extents counted as one"):
        decode_descriptor(raw)
    forged = _tampered(lambda w: w["tensors"][0].update(shape=[2, *shape, 3, 16]))
    with pytest.raises(DescriptorError, match=r"tensor 'data' of shape \[2, .*\] \(int64\) spans over the"):
        decode_descriptor(forged)


def test_zero_element_tensors_of_ordinary_extents_still_transfer() -> None:
    empty = torch.empty((0, 3, 2**20), dtype=torch.int64)
    descriptor = decode_descriptor(_wire(empty))
    received, _ = allocate_value(descriptor, CPU)
    assert received.shape == (0, 3, 2**20)


def test_receive_total_cap_covers_every_value_of_a_collective() -> None:
    assert MAX_RECEIVE_BYTES >= MAX_TRANSFER_BYTES
    check_receive_total(MAX_RECEIVE_BYTES, "dst")
    with pytest.raises(DescriptorError, match=r"dst would allocate \d+ bytes in total to receive"):
        check_receive_total(MAX_RECEIVE_BYTES + 1, "dst")


def test_cap_is_large_enough_for_real_ciphertexts() -> None:
    assert MAX_TRANSFER_BYTES >= 2 * 64 * 65536 * 8


def test_cuda_descriptor_needs_a_cuda_rank() -> None:
    wire = _wire(ciphertext())
    wire["tensors"][0]["device_type"] = "cuda"
    descriptor = decode_descriptor(wire)
    assert isinstance(descriptor, ValueDescriptor)
    with pytest.raises(
        DescriptorError, match="cannot receive a CUDA tensor on a rank whose local device is cpu"
    ):
        allocate_value(descriptor, CPU)


def test_subclasses_and_foreign_objects_have_no_descriptor() -> None:
    with pytest.raises(DescriptorError, match="exact fhelium values"):
        describe_value(object())
    with pytest.raises(DescriptorError, match="strided"):
        describe_value(torch.zeros(2, 2).to_sparse())
