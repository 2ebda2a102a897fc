"""Registered implementations of the `fhelium_dist` operations on torch.distributed.

The generic all-reduce all-gathers equal-layout payloads and folds them in group-rank order through
the compiled combine region: ((v0 + v1) + v2) + ..., so every rank computes the same value even when
the combine is not associative. The specialized ciphertext-add all-reduce hands the whole operation
to `fhelium.distributed.all_reduce_ciphertext`, with additions done by the same registered
`fhelium_ckks.add` implementation the lowered form uses, so both forms give identical ciphertexts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as torch_dist
from xdsl.dialects.builtin import IntegerAttr
from xdsl.ir import Operation

from fhelium.backend.distributed.resources import PROCESS_GROUP_RESOURCE_KIND, ProcessGroupExecutionResource
from fhelium.backend.implementation import (
    ImplementationError,
    OperandResourcesOnly,
    OperationImplementation,
    OperationInvocation,
    RegionCallable,
    Regions,
    Resources,
    Tensors,
)
from fhelium.backend.resources import BoundResource, ResourceRequirement
from fhelium.backend.rns.operations import (
    RNS_MODULI_RESOURCE_SYMBOL,
    TorchRnsAddImplementation,
    operand_prime_ids,
)
from fhelium.core import Ciphertext
from fhelium.distributed import (
    CiphertextAdder,
    ReductionTrace,
    ResidueModuliAdder,
    all_reduce_ciphertext,
    steps,
)
from fhelium.ir import OpenStateType
from fhelium.ir.dialects import ckks
from fhelium.ir.dialects import distributed as dist


def _group(op_name: str, resources: Sequence[BoundResource]) -> ProcessGroupExecutionResource:
    for resource in resources:
        if resource.kind == PROCESS_GROUP_RESOURCE_KIND and isinstance(
            resource.value, ProcessGroupExecutionResource
        ):
            return resource.value
    raise ImplementationError(f"{op_name} needs a bound {PROCESS_GROUP_RESOURCE_KIND!r} resource")


def check_equal_layout(op_name: str, value: torch.Tensor, group: ProcessGroupExecutionResource) -> None:
    """Agree on shape, dtype and device type before the payload moves, through the same control
    exchange as ``fhelium.distributed``'s typed collectives (each rank's tensor descriptor, then the
    same comparison everywhere): a mismatch raises the same ``CollectiveArgumentError`` on every
    rank before any payload moves, and the group stays usable.
    """
    info = steps.group_info(group.process_group)
    descriptor, error = steps.describe_or_error(value)
    steps.agree_on_layout(info, op_name, arguments={}, error=error, descriptor=descriptor)


class TorchProcessGroupQueryImplementation(OperandResourcesOnly):
    """`fhelium_dist.rank` / `.group_size` -> a 0-d int64 tensor."""

    name = "torch-process-group-query"
    operation_types: tuple[type[Operation], ...] = (dist.RankOp, dist.GroupSizeOp)

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        group = _group(invocation.operation_name, resources)
        value = group.rank if invocation.operation_name == dist.RankOp.name else group.size
        return (torch.tensor(value, dtype=torch.int64),)


class TorchBroadcastImplementation(OperandResourcesOnly):
    """Functional broadcast: the input is cloned, never overwritten."""

    name = "torch-broadcast"
    operation_types: tuple[type[Operation], ...] = (dist.BroadcastOp,)

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        (value,) = inputs
        group = _group(invocation.operation_name, resources)
        root_attr = invocation.attributes["root"]
        assert isinstance(root_attr, IntegerAttr)
        root = int(root_attr.value.data)
        if not 0 <= root < group.size:
            raise ImplementationError(
                f"fhelium_dist.broadcast root {root} is not a group rank; the group has {group.size} ranks"
            )
        out = value.clone(memory_format=torch.contiguous_format)
        if group.size > 1:
            check_equal_layout(invocation.operation_name, out, group)
            torch_dist.broadcast(out, src=group.global_rank(root), group=group.process_group)
        return (out,)


def collective_fold(
    op_name: str, value: torch.Tensor, group: ProcessGroupExecutionResource, combine: RegionCallable
) -> torch.Tensor:
    """All-gather `value` and fold the contributions in group-rank order with `combine`."""
    if group.size == 1:
        return value.clone()
    check_equal_layout(op_name, value, group)
    local = value.contiguous()
    gathered = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(group.size)]
    torch_dist.all_gather(gathered, local, group=group.process_group)
    accumulator = gathered[0]
    for contribution in gathered[1:]:
        outputs = combine(accumulator, contribution)
        if len(outputs) != 1:
            raise ImplementationError(f"{op_name} combine region must yield one value, got {len(outputs)}")
        accumulator = outputs[0]
    return accumulator


class TorchGenericAllReduceImplementation(OperandResourcesOnly):
    name = "torch-generic-all-reduce"
    operation_types: tuple[type[Operation], ...] = (dist.AllReduceOp,)

    def execute_regions(
        self, invocation: OperationInvocation, inputs: Tensors, resources: Resources, regions: Regions
    ) -> Tensors:
        (value,) = inputs
        (combine,) = regions
        group = _group(invocation.operation_name, resources)
        return (collective_fold(invocation.operation_name, value, group, combine),)


class _RegistryAddEngine(CiphertextAdder):
    """The adder fhelium.distributed needs, with additions from a Backend implementation."""

    def __init__(
        self, add: OperationImplementation, invocation: OperationInvocation, rns: BoundResource
    ) -> None:
        self._add = add
        self._invocation = invocation
        self._rns = rns

    def moduli_for(self, prime_ids: Sequence[int]) -> list[int]:
        moduli: list[int] = self._rns.value.moduli_for(prime_ids)
        return moduli

    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        (total,) = self._add.execute(self._invocation, (lhs.data, rhs.data), (self._rns,))
        lhs.data.copy_(total)
        return lhs


class _RegistryModularAddEngine(_RegistryAddEngine, ResidueModuliAdder):
    """The adder over an add implementation that declares ``canonical_modular_add``: it also names
    the moduli, so ``all_reduce_ciphertext`` may take the ``sum`` schedule where that is exact.
    """

    def residue_moduli(self, value: Ciphertext) -> list[int]:
        return self.moduli_for(value.prime_ids)


class TorchCiphertextAddAllReduceImplementation:
    """Whole-operation `all_reduce_add_ciphertext` through `fhelium.distributed.all_reduce_ciphertext`.

    When the add implementation declares ``canonical_modular_add = True`` (``TorchRnsAddImplementation``
    does: its result is ``(lhs + rhs) mod q`` in ``[0, q)`` with ``q`` from its bound ``rns-moduli``
    resource), the adder handed over is a ``ResidueModuliAdder`` and the all-reduce takes the
    one-step ``sum`` schedule where it is exact; any other add implementation gets the tree.
    ``last_trace`` is this rank's ``ReductionTrace`` of the latest execution (diagnostics, tests).
    """

    name = "torch-ciphertext-add-all-reduce"
    operation_types: tuple[type[Operation], ...] = (dist.AllReduceAddCiphertextOp,)

    def __init__(
        self,
        add: OperationImplementation | None = None,
        *,
        rns_symbol: str = RNS_MODULI_RESOURCE_SYMBOL,
    ) -> None:
        self.add = add if add is not None else TorchRnsAddImplementation(rns_symbol)
        self.rns_symbol = rns_symbol
        self.last_trace: ReductionTrace | None = None

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]:
        return self.add.resource_requirements(self._add_invocation(invocation))

    @staticmethod
    def _add_invocation(invocation: OperationInvocation) -> OperationInvocation:
        value_type = invocation.operand_types[0]
        return OperationInvocation(ckks.AddOp.name, 2, 1, {}, (value_type, value_type), (value_type,))

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        (value,) = inputs
        group = _group(invocation.operation_name, resources)
        add_invocation = self._add_invocation(invocation)
        add_resources = resources[-len(self.resource_requirements(invocation)) :]
        value_type = invocation.operand_types[0]
        assert isinstance(value_type, OpenStateType)
        prime_ids = operand_prime_ids(value_type, int(value.size(-2)))
        # Scale and depth do not affect modular addition; the wrapper only carries the payload.
        ciphertext = Ciphertext(
            data=value.clone(memory_format=torch.contiguous_format),
            depth=value_type.state_int("depth") or 0,
            scale=1.0,
            prime_ids=prime_ids,
            modulus_basis=value_type.state_str("basis") or "Q",  # type: ignore[arg-type]  # checked by Ciphertext
        )
        modular = getattr(self.add, "canonical_modular_add", False) is True
        adder = _RegistryModularAddEngine if modular else _RegistryAddEngine
        trace = ReductionTrace()
        all_reduce_ciphertext(
            ciphertext,
            engine=adder(self.add, add_invocation, add_resources[0]),
            group=group.process_group,
            trace=trace,
        )
        self.last_trace = trace
        return (ciphertext.data,)


def distributed_operation_contributions(
    *, ciphertext_add: TorchCiphertextAddAllReduceImplementation | None = None
) -> tuple[Any, ...]:
    """The generic collective implementations, plus the specialized one when given."""
    generic: tuple[Any, ...] = (
        TorchProcessGroupQueryImplementation(),
        TorchBroadcastImplementation(),
        TorchGenericAllReduceImplementation(),
    )
    return generic if ciphertext_add is None else (*generic, ciphertext_add)
