"""Per-limb modular add/subtract/negate on `[component, *batch, limb, N]` residue tensors.

The moduli come from a bound resource of kind "rns-moduli" whose value answers
`moduli_for(prime_ids) -> list[int]` (the CKKS engine satisfies this, and so does `RnsModuli`).
Prime ids come from the operand type state (`prime_ids = [...]`); without them, a Q-basis value at
depth d with L limbs holds ids d .. d+L-1 (compact rows of the active chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from xdsl.ir import Attribute, Operation

from fhelium.backend.implementation import ImplementationError, OperationInvocation, Resources, Tensors
from fhelium.backend.resources import ResourceRequirement
from fhelium.ir import OpenStateType
from fhelium.ir.dialects import ckks

RNS_MODULI_RESOURCE_KIND = "rns-moduli"
RNS_MODULI_RESOURCE_SYMBOL = "rns"


class ModuliSource(Protocol):
    def moduli_for(self, prime_ids: Sequence[int]) -> list[int]: ...


@dataclass(frozen=True)
class RnsModuli:
    """A plain prime table indexed by prime id (canonical [Q | P] order)."""

    moduli: tuple[int, ...]

    def moduli_for(self, prime_ids: Sequence[int]) -> list[int]:
        out = []
        for prime_id in prime_ids:
            if not 0 <= prime_id < len(self.moduli):
                raise ImplementationError(
                    f"prime id {prime_id} is outside the bound RNS chain of {len(self.moduli)} primes"
                )
            out.append(self.moduli[prime_id])
        return out


def operand_prime_ids(value_type: Attribute, limb_count: int) -> tuple[int, ...]:
    """Prime ids of a value of `value_type` whose payload has `limb_count` limb rows."""
    if not isinstance(value_type, OpenStateType):
        raise ImplementationError(f"RNS operation operand must have a fhelium value type, got {value_type}")
    declared = value_type.state_ints("prime_ids")
    if declared is not None:
        if len(declared) != limb_count:
            raise ImplementationError(
                f"{value_type} declares {len(declared)} prime ids but the payload has {limb_count} limb rows"
            )
        return declared
    basis = value_type.state_str("basis") or "Q"
    if basis != "Q":
        raise ImplementationError(
            f"{value_type} has basis {basis!r} but no prime_ids; declare prime_ids in the type state"
        )
    depth = value_type.state_int("depth") or 0
    return tuple(range(depth, depth + limb_count))


def moduli_column(
    invocation: OperationInvocation, payload: torch.Tensor, source: ModuliSource
) -> torch.Tensor:
    """The moduli shaped to broadcast over the limb axis (dim -2) of `payload`."""
    limb_count = int(payload.size(-2))
    prime_ids = operand_prime_ids(invocation.operand_types[0], limb_count)
    moduli = source.moduli_for(prime_ids)
    return torch.tensor(moduli, dtype=payload.dtype, device=payload.device).unsqueeze(-1)


def rns_add(lhs: torch.Tensor, rhs: torch.Tensor, moduli: torch.Tensor) -> torch.Tensor:
    """(lhs + rhs) mod q for canonical residues in [0, q); q < 2^62 so the sum cannot overflow."""
    total = lhs + rhs
    return torch.where(total >= moduli, total - moduli, total)


def rns_subtract(lhs: torch.Tensor, rhs: torch.Tensor, moduli: torch.Tensor) -> torch.Tensor:
    difference = lhs - rhs
    return torch.where(difference < 0, difference + moduli, difference)


def rns_negate(value: torch.Tensor, moduli: torch.Tensor) -> torch.Tensor:
    return torch.where(value == 0, value, moduli - value)


class _RnsImplementation:
    """Shared shape of the RNS implementations: moduli from one bound resource, one result."""

    operation_types: tuple[type[Operation], ...] = ()
    name = ""

    def __init__(self, resource_symbol: str = RNS_MODULI_RESOURCE_SYMBOL) -> None:
        self.resource_symbol = resource_symbol

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]:
        return (ResourceRequirement(self.resource_symbol, RNS_MODULI_RESOURCE_KIND),)

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        if len(inputs) == 2:
            _check_same_layout(invocation.operation_name, inputs[0], inputs[1])
        moduli = moduli_column(invocation, inputs[0], resources[-1].value)
        return (self._compute(inputs, moduli),)

    def _compute(self, inputs: tuple[torch.Tensor, ...], moduli: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _check_same_layout(name: str, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
    if lhs.shape != rhs.shape or lhs.dtype != rhs.dtype or lhs.device != rhs.device:
        raise ImplementationError(
            f"{name} operands must share shape, dtype and device; got {tuple(lhs.shape)} {lhs.dtype} "
            f"{lhs.device} and {tuple(rhs.shape)} {rhs.dtype} {rhs.device}"
        )


class TorchRnsAddImplementation(_RnsImplementation):
    name = "torch-rns-add"
    operation_types: tuple[type[Operation], ...] = (ckks.AddOp,)
    #: The result is (lhs + rhs) mod q in [0, q), q from the bound rns-moduli resource: the
    #: ciphertext all-reduce may then use its exact one-step ``sum`` schedule.
    canonical_modular_add = True

    def _compute(self, inputs: tuple[torch.Tensor, ...], moduli: torch.Tensor) -> torch.Tensor:
        return rns_add(inputs[0], inputs[1], moduli)


class TorchRnsSubtractImplementation(_RnsImplementation):
    name = "torch-rns-subtract"
    operation_types: tuple[type[Operation], ...] = (ckks.SubtractOp,)

    def _compute(self, inputs: tuple[torch.Tensor, ...], moduli: torch.Tensor) -> torch.Tensor:
        return rns_subtract(inputs[0], inputs[1], moduli)


class TorchRnsNegateImplementation(_RnsImplementation):
    name = "torch-rns-negate"
    operation_types: tuple[type[Operation], ...] = (ckks.NegateOp,)

    def _compute(self, inputs: tuple[torch.Tensor, ...], moduli: torch.Tensor) -> torch.Tensor:
        return rns_negate(inputs[0], moduli)


def ckks_operation_contributions(
    resource_symbol: str = RNS_MODULI_RESOURCE_SYMBOL,
) -> tuple[_RnsImplementation, ...]:
    """The default `fhelium_ckks` implementations, all reading moduli from `resource_symbol`."""
    return (
        TorchRnsAddImplementation(resource_symbol),
        TorchRnsSubtractImplementation(resource_symbol),
        TorchRnsNegateImplementation(resource_symbol),
    )
