"""Device resources and the tensor transfer implementation."""

from __future__ import annotations

from fhelium.backend.memory.operations import (
    TorchMemoryTransferImplementation,
    memory_operation_contributions,
    pinned_memory_available,
    transfer_tensor,
)
from fhelium.backend.memory.resources import DEVICE_RESOURCE_KIND, bind_device

__all__ = [
    "DEVICE_RESOURCE_KIND",
    "TorchMemoryTransferImplementation",
    "bind_device",
    "memory_operation_contributions",
    "pinned_memory_available",
    "transfer_tensor",
]
