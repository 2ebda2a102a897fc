"""The `fhelium_ckks` dialect: CKKS value types and the arithmetic that combine regions need.

Only operations whose semantics are one modular RNS step are declared here (add, subtract, negate);
they are what generic collectives need inside combine regions. Relinearisation, rescaling and key
switching are deliberately absent: they need evaluation keys the Backend does not bind yet.
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.ir import Dialect, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    VarConstraint,
    base,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure

from fhelium.ir.dialects._common import OpenStateType


@irdl_attr_definition
class CiphertextType(OpenStateType):
    """A CKKS ciphertext. Known state keys: depth, components, basis, prime_ids, domain."""

    name = "fhelium_ckks.ciphertext"


@irdl_attr_definition
class PlaintextType(OpenStateType):
    """An encoded CKKS plaintext in RNS form. Known state keys as for ciphertexts."""

    name = "fhelium_ckks.plaintext"


class _BinaryCiphertextOp(IRDLOperation):
    # Both operands and the result are one ciphertext type (same state): xDSL checks it.
    T: ClassVar = VarConstraint("T", base(CiphertextType))

    lhs = operand_def(T)
    rhs = operand_def(T)
    result = result_def(T)

    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue) -> None:
        super().__init__(operands=[lhs, rhs], result_types=[lhs.type])


@irdl_op_definition
class AddOp(_BinaryCiphertextOp):
    """Per-limb modular addition of two ciphertexts in the same state."""

    name = "fhelium_ckks.add"


@irdl_op_definition
class SubtractOp(_BinaryCiphertextOp):
    """Per-limb modular subtraction `lhs - rhs` of two ciphertexts in the same state."""

    name = "fhelium_ckks.subtract"


@irdl_op_definition
class NegateOp(IRDLOperation):
    """Per-limb modular negation of a ciphertext."""

    name = "fhelium_ckks.negate"

    T: ClassVar = VarConstraint("T", base(CiphertextType))

    value = operand_def(T)
    result = result_def(T)

    traits = traits_def(Pure())

    def __init__(self, value: SSAValue) -> None:
        super().__init__(operands=[value], result_types=[value.type])


FHEliumCkks = Dialect("fhelium_ckks", [AddOp, SubtractOp, NegateOp], [CiphertextType, PlaintextType])
