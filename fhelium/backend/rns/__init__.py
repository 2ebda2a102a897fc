"""Tensor implementations of the `fhelium_ckks` RNS operations."""

from __future__ import annotations

from fhelium.backend.rns.operations import (
    RNS_MODULI_RESOURCE_KIND,
    RNS_MODULI_RESOURCE_SYMBOL,
    RnsModuli,
    TorchRnsAddImplementation,
    TorchRnsNegateImplementation,
    TorchRnsSubtractImplementation,
    ckks_operation_contributions,
    operand_prime_ids,
    rns_add,
)

__all__ = [
    "RNS_MODULI_RESOURCE_KIND",
    "RNS_MODULI_RESOURCE_SYMBOL",
    "RnsModuli",
    "TorchRnsAddImplementation",
    "TorchRnsNegateImplementation",
    "TorchRnsSubtractImplementation",
    "ckks_operation_contributions",
    "operand_prime_ids",
    "rns_add",
]
