"""Payload staging for the typed collectives (step 4 of `fhelium.distributed._collective_common`):
send buffers on the group's device, receive slots copied back into the caller's tensor, point-to-point
batches, and the broadcast/all-gather whose storage is allocated before the allocation is agreed.

Everything here runs after the control exchange agreed that every rank proceeds; each payload phase
runs under `collective_phase`, so a peer that never arrives names the operation and the phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fhelium.distributed._collective_common import GroupInfo, collective_phase


def may_overlap(tensor: torch.Tensor) -> bool:
    """True unless the strides prove that no two indices address the same element.

    Conservative: sorts the non-trivial axes by stride and requires each stride to step past
    everything the smaller axes span (true for any permuted dense or sliced layout).
    """
    axes = sorted(
        (stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1
    )
    span = 0
    for stride, size in axes:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_writable_destination(tensor: torch.Tensor, what: str) -> None:
    if tensor.numel() > 0 and may_overlap(tensor):
        raise ValueError(
            f"{what} has overlapping elements (shape {tuple(tensor.shape)}, strides {tensor.stride()}), "
            "so a receive into it is ambiguous; pass a tensor with distinct elements (e.g. .clone())"
        )


def send_buffer(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor itself if it is contiguous on ``device``; otherwise a packed copy (source untouched)."""
    if tensor.is_contiguous() and tensor.device == device:
        return tensor
    packed = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    packed.copy_(tensor)
    return packed


@dataclass(frozen=True)
class ReceiveSlot:
    """A destination view and the contiguous transport buffer that stands in for it."""

    target: torch.Tensor
    buffer: torch.Tensor

    @property
    def staged(self) -> bool:
        return self.buffer is not self.target

    def finish(self) -> None:
        """Copy a staged receive into the target view, touching nothing outside it."""
        if self.staged:
            self.target.copy_(self.buffer)


def receive_slot(
    target: torch.Tensor, device: torch.device, what: str = "receive destination"
) -> ReceiveSlot:
    check_writable_destination(target, what)
    if target.is_contiguous() and target.device == device:
        return ReceiveSlot(target, target)
    # torch.empty, not empty_like: empty_like would copy the view's strides.
    return ReceiveSlot(target, torch.empty(target.shape, dtype=target.dtype, device=device))


def broadcast_tensor(tensor: torch.Tensor, *, src_global: int, info: GroupInfo, operation: str) -> None:
    """Broadcast into/out of ``tensor`` with packing on the source and copy-back on receivers."""
    with collective_phase(info, operation, "payload broadcast"):
        if info.global_rank == src_global:
            dist.broadcast(send_buffer(tensor, info.transport_device), src=src_global, group=info.group)
        else:
            slot = receive_slot(tensor, info.transport_device)
            dist.broadcast(slot.buffer, src=src_global, group=info.group)
            slot.finish()


@dataclass
class PointToPointBatch:
    """Sends and receives posted together (``batch_isend_irecv``), then waited and copied back."""

    info: GroupInfo
    operations: list[dist.P2POp] = field(default_factory=list)
    slots: list[ReceiveSlot] = field(default_factory=list)
    # Keeps packed send buffers alive until the batch completes.
    _sent: list[torch.Tensor] = field(default_factory=list)

    def send(self, tensor: torch.Tensor, peer_global: int, tag: int) -> None:
        buffer = send_buffer(tensor, self.info.transport_device)
        self._sent.append(buffer)
        self.operations.append(dist.P2POp(dist.isend, buffer, peer_global, self.info.group, tag))

    def receive(self, target: torch.Tensor, peer_global: int, tag: int) -> None:
        slot = receive_slot(target, self.info.transport_device)
        self.slots.append(slot)
        self.operations.append(dist.P2POp(dist.irecv, slot.buffer, peer_global, self.info.group, tag))

    def run(self, operation: str, phase: str) -> None:
        try:
            if self.operations:
                with collective_phase(self.info, operation, phase):
                    for work in dist.batch_isend_irecv(self.operations):
                        work.wait()
            for slot in self.slots:
                slot.finish()
        finally:  # a failed batch releases its staging and packed buffers too
            self.operations.clear()
            self.slots.clear()
            self._sent.clear()


@dataclass
class PreparedBroadcast:
    """One leaf of a broadcast with its transport storage allocated up front (see
    :func:`agree_on_allocation`): the source's packed buffer, or a receiver's slot.
    """

    buffer: torch.Tensor
    slot: ReceiveSlot | None = None

    @classmethod
    def source(cls, tensor: torch.Tensor, info: GroupInfo) -> PreparedBroadcast:
        return cls(send_buffer(tensor, info.transport_device))

    @classmethod
    def receiver(cls, target: torch.Tensor, info: GroupInfo) -> PreparedBroadcast:
        slot = receive_slot(target, info.transport_device)
        return cls(slot.buffer, slot)

    def run(self, *, src_global: int, info: GroupInfo, operation: str) -> None:
        with collective_phase(info, operation, "payload broadcast"):
            dist.broadcast(self.buffer, src=src_global, group=info.group)
        if self.slot is not None:
            self.slot.finish()


@dataclass
class PreparedAllGather:
    """One leaf of an all-gather: its send buffer and the ``size`` outputs, allocated up front."""

    source: torch.Tensor
    staged: torch.Tensor
    outputs: list[torch.Tensor]

    @classmethod
    def allocate(cls, tensor: torch.Tensor, info: GroupInfo) -> PreparedAllGather:
        staged = send_buffer(tensor, info.transport_device)
        outputs = [
            torch.empty(tensor.shape, dtype=tensor.dtype, device=info.transport_device)
            for _ in range(info.size)
        ]
        return cls(tensor, staged, outputs)

    def run(self, *, info: GroupInfo, operation: str) -> list[torch.Tensor]:
        """Results are fresh contiguous tensors on the source tensor's device."""
        with collective_phase(info, operation, "payload all-gather"):
            dist.all_gather(self.outputs, self.staged, group=info.group)
        device = self.source.device
        return [t if t.device == device else t.to(device) for t in self.outputs]


# -- the shared steps of every typed collective -----------------------------------------------
