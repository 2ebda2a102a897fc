"""`fhelium_memory.transfer` on tensor payloads: synchronous, functional, delegated to PyTorch."""

from __future__ import annotations

import torch
from xdsl.dialects.builtin import StringAttr
from xdsl.ir import Operation

from fhelium.backend.implementation import (
    ImplementationError,
    OperandResourcesOnly,
    OperationInvocation,
    Resources,
    Tensors,
)
from fhelium.backend.memory.resources import DEVICE_RESOURCE_KIND
from fhelium.ir.dialects import memory


def pinned_memory_available() -> bool:
    """Whether this PyTorch runtime can allocate page-locked host memory (needs an accelerator)."""
    try:
        return bool(torch.empty(1).pin_memory().is_pinned())
    except RuntimeError:
        return False


def transfer_tensor(
    source: torch.Tensor, target: torch.device, memory_space: str = "default"
) -> torch.Tensor:
    """Move `source` to `target` in `memory_space`; same-device default transfers return `source`."""
    if memory_space not in memory.MEMORY_SPACES:
        raise ImplementationError(
            f"memory_space must be one of {', '.join(memory.MEMORY_SPACES)}; got {memory_space!r}"
        )
    if memory_space == "default":
        return source.to(target)
    if target.type != "cpu":
        raise ImplementationError(f"Memory space {memory_space!r} requires a CPU target device; got {target}")
    if memory_space == "pinned_host":
        if source.device.type == "cpu" and source.is_pinned():
            return source
        try:
            return source.to("cpu").pin_memory()
        except RuntimeError as error:
            raise ImplementationError(
                f"Pinned host storage is unavailable in the current PyTorch runtime ({error}); use "
                'memory_space = "pageable_host" or run where an accelerator provides pinned memory'
            ) from error
    # pageable_host: a CPU tensor that does not live in pinned storage.
    if source.device.type == "cpu" and not source.is_pinned():
        return source
    return source.to("cpu", copy=True)


class TorchMemoryTransferImplementation(OperandResourcesOnly):
    name = "torch-memory-transfer"
    operation_types: tuple[type[Operation], ...] = (memory.TransferOp,)

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        (source,) = inputs
        (device,) = resources
        if device.kind != DEVICE_RESOURCE_KIND or not isinstance(device.value, torch.device):
            raise ImplementationError(
                f"fhelium_memory.transfer target must be bound as a {DEVICE_RESOURCE_KIND!r} resource "
                f"holding a torch.device; {device.symbol!r} is {device.kind!r}"
            )
        space = invocation.attributes.get("memory_space")
        name = space.data if isinstance(space, StringAttr) else "default"
        return (transfer_tensor(source, device.value, name),)


def memory_operation_contributions() -> tuple[TorchMemoryTransferImplementation, ...]:
    return (TorchMemoryTransferImplementation(),)
