"""Staging rules and control records, in one process (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from fhelium.distributed._collective_common import (
    ControlRecord,
)
from fhelium.distributed._staging import check_writable_destination, may_overlap, receive_slot, send_buffer

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("make", "overlapping"),
    [
        (lambda: torch.zeros(3, 4), False),
        (lambda: torch.zeros(3, 4).t(), False),
        (lambda: torch.zeros(2, 5, 8)[:, 1:3, :], False),
        (lambda: torch.zeros(4, 6)[::2, 1::3], False),
        (lambda: torch.zeros(1, 4).expand(3, 4), True),
        (lambda: torch.zeros(10).as_strided((3, 3), (2, 1)), True),
        (lambda: torch.zeros(1), False),
    ],
)
def test_overlap_detection(make: object, overlapping: bool) -> None:
    tensor = make()  # type: ignore[operator]  # parametrized factories
    assert may_overlap(tensor) is overlapping
    offsets = torch.zeros(tensor.shape, dtype=torch.int64)
    for axis, stride in enumerate(tensor.stride()):
        shape = [1] * tensor.ndim
        shape[axis] = tensor.shape[axis]
        offsets = offsets + torch.arange(tensor.shape[axis]).reshape(shape) * stride
    brute_force = len(set(offsets.flatten().tolist())) != offsets.numel()
    assert brute_force is overlapping


def test_overlapping_destinations_are_refused() -> None:
    with pytest.raises(ValueError, match="overlapping elements"):
        check_writable_destination(torch.zeros(1, 4).expand(3, 4), "the destination")
    with pytest.raises(ValueError, match="overlapping elements"):
        receive_slot(torch.zeros(1, 4).expand(3, 4), CPU)


def test_contiguous_send_goes_direct_and_others_are_packed_without_touching_the_source() -> None:
    base = torch.arange(40).reshape(2, 5, 4)
    assert send_buffer(base, CPU) is base
    view = base[:, 1:3, :]
    before = base.clone()
    packed = send_buffer(view, CPU)
    assert packed.is_contiguous() and packed.data_ptr() != base.data_ptr()
    assert torch.equal(packed, view) and torch.equal(base, before)


def test_staged_receive_copies_back_into_the_view_only() -> None:
    base = torch.zeros(2, 5, 4, dtype=torch.int64)
    view = base[:, 1:3, :]
    strides, pointer = view.stride(), view.data_ptr()
    slot = receive_slot(view, CPU)
    assert slot.staged and slot.buffer.is_contiguous() and slot.buffer.shape == view.shape
    slot.buffer.copy_(torch.arange(16).reshape(2, 2, 4) + 1)
    slot.finish()
    assert view.stride() == strides and view.data_ptr() == pointer
    assert torch.equal(view, torch.arange(16).reshape(2, 2, 4) + 1)
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[:, 1:3, :] = False
    assert int(base[outside].abs().sum()) == 0


def test_contiguous_receive_uses_the_destination_itself() -> None:
    target = torch.zeros(3, 4)
    slot = receive_slot(target, CPU)
    assert not slot.staged and slot.buffer is target


def test_control_record_round_trips_as_json_and_rejects_other_shapes() -> None:
    record = ControlRecord(
        "broadcast_ciphertext", {"src": 1}, None, {"descriptor": None, "device_type": "cpu"}
    )
    assert ControlRecord.decode(record.encode()) == record
    with pytest.raises(ValueError, match="malformed"):
        ControlRecord.decode(b'{"operation": "x"}')
