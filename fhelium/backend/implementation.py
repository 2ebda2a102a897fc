"""The Backend's operation ABI: invocations, implementation protocols, and the registry.

Implementations see only `torch.Tensor` payloads and bound resources; public value objects are
decomposed at the Program boundary. An implementation recorded in the IR (the
`fhelium.execution.implementation` attribute) is a hard constraint; otherwise the registry's single
default for the operation is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from xdsl.dialects.builtin import StringAttr
from xdsl.ir import Attribute, Operation

from fhelium.backend.resources import BoundResource, ResourceRequirement
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, operation_name


class ImplementationError(LookupError):
    """No usable implementation for an operation, or an ambiguous choice."""


@dataclass(frozen=True)
class OperationInvocation:
    """What an implementation may know about one operation instance (no SSA, no runtime values)."""

    operation_name: str
    operand_count: int
    result_count: int
    attributes: Mapping[str, Attribute] = field(default_factory=dict[str, Attribute])
    operand_types: tuple[Attribute, ...] = ()
    result_types: tuple[Attribute, ...] = ()

    @classmethod
    def of(cls, op: Operation) -> OperationInvocation:
        return cls(
            operation_name=op.name,
            operand_count=len(op.operands),
            result_count=len(op.results),
            attributes=dict(op.attributes),
            operand_types=tuple(operand.type for operand in op.operands),
            result_types=tuple(result.type for result in op.results),
        )


#: A compiled region: call it with the region's block arguments, get the yielded tensors.
RegionCallable = Callable[..., tuple[torch.Tensor, ...]]
#: The tensor payloads an implementation receives and returns, in operand / result order.
Tensors = tuple[torch.Tensor, ...]
#: The bound resources it receives: resource operands first, then its `resource_requirements`.
Resources = tuple[BoundResource, ...]
#: One callable per region of the operation.
Regions = tuple[RegionCallable, ...]


class _Implementation(Protocol):
    name: str
    operation_types: tuple[type[Operation], ...]

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]: ...


@runtime_checkable
class OperationImplementation(_Implementation, Protocol):
    """Executes one or more operation classes on tensor payloads."""

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors: ...


@runtime_checkable
class RegionOperationImplementation(_Implementation, Protocol):
    """Executes a region-owning operation; the Backend passes each region as a callable."""

    def execute_regions(
        self, invocation: OperationInvocation, inputs: Tensors, resources: Resources, regions: Regions
    ) -> Tensors: ...


Implementation = OperationImplementation | RegionOperationImplementation


class OperandResourcesOnly:
    """Base for an implementation whose resources all arrive as operands (a group, a device): it
    asks the Backend for nothing more at link time.
    """

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]:
        return ()


class OperationImplementationRegistry:
    """Implementations by (operation class, implementation name)."""

    def __init__(self, implementations: Iterable[Implementation] = ()) -> None:
        self._by_type: dict[type[Operation], dict[str, Implementation]] = {}
        for implementation in implementations:
            self.register(implementation)

    def register(self, implementation: Implementation) -> None:
        for op_type in implementation.operation_types:
            named = self._by_type.setdefault(op_type, {})
            if implementation.name in named:
                raise ImplementationError(
                    f"implementation {implementation.name!r} is already registered for {op_type.name}"
                )
            named[implementation.name] = implementation

    def extend(self, implementations: Iterable[Implementation]) -> OperationImplementationRegistry:
        for implementation in implementations:
            self.register(implementation)
        return self

    def names_for(self, op_type: type[Operation]) -> tuple[str, ...]:
        return tuple(self._by_type.get(op_type, {}))

    def covers(self, op: Operation) -> bool:
        return type(op) in self._by_type

    def default_assignments(self) -> dict[str, str]:
        """Operation name -> implementation name, for operations with exactly one implementation."""
        return {
            op_type.name: next(iter(named))
            for op_type, named in self._by_type.items()
            if len(named) == 1
        }

    def resolve(self, op: Operation) -> Implementation:
        named = self._by_type.get(type(op), {})
        requested = op.attributes.get(EXECUTION_IMPLEMENTATION_ATTRIBUTE)
        if requested is not None:
            if not isinstance(requested, StringAttr):
                raise ImplementationError(
                    f"{op.name}: {EXECUTION_IMPLEMENTATION_ATTRIBUTE} must be a string, got {requested}"
                )
            try:
                return named[requested.data]
            except KeyError:
                known = ", ".join(named) or "none"
                raise ImplementationError(
                    f"{op.name} requests implementation {requested.data!r}, which is not registered; "
                    f"registered for this operation: {known}"
                ) from None
        if not named:
            raise ImplementationError(
                f"no Backend implementation is registered for {operation_name(op)}; register one or lower "
                "the operation before linking"
            )
        if len(named) > 1:
            raise ImplementationError(
                f"{op.name} has several implementations ({', '.join(named)}); pick one with the "
                f"{EXECUTION_IMPLEMENTATION_ATTRIBUTE} attribute"
            )
        return next(iter(named.values()))
