"""fhelium Backend: link rank-local Programs to tensor implementations and launch-bound resources.

See docs/fhelium-backend.md.
"""

from __future__ import annotations

from fhelium.backend.distributed.operations import (
    TorchCiphertextAddAllReduceImplementation,
    distributed_operation_contributions,
)
from fhelium.backend.execution import ExecutionError, OperationBackend, ProgramExecutable
from fhelium.backend.implementation import (
    ImplementationError,
    OperandResourcesOnly,
    OperationImplementation,
    OperationImplementationRegistry,
    OperationInvocation,
    RegionOperationImplementation,
)
from fhelium.backend.memory.operations import memory_operation_contributions
from fhelium.backend.resources import BoundResource, ResourceBindings, ResourceError, ResourceRequirement
from fhelium.backend.rns.operations import ckks_operation_contributions


def default_registry(*, specialized_ciphertext_add: bool = True) -> OperationImplementationRegistry:
    """CKKS RNS ops, memory transfer and the collectives (with the specialized all-reduce if asked)."""
    ckks_ops = ckks_operation_contributions()
    specialized = (
        TorchCiphertextAddAllReduceImplementation(ckks_ops[0]) if specialized_ciphertext_add else None
    )
    registry = OperationImplementationRegistry(ckks_ops)
    registry.extend(memory_operation_contributions())
    registry.extend(distributed_operation_contributions(ciphertext_add=specialized))
    return registry


__all__ = [
    "BoundResource",
    "ExecutionError",
    "ImplementationError",
    "OperandResourcesOnly",
    "OperationBackend",
    "OperationImplementation",
    "OperationImplementationRegistry",
    "OperationInvocation",
    "ProgramExecutable",
    "RegionOperationImplementation",
    "ResourceBindings",
    "ResourceError",
    "ResourceRequirement",
    "default_registry",
]
