"""The `fhelium_memory` dialect: explicit, functional placement changes.

`fhelium_memory.transfer` is the only operation that moves a value between devices; arithmetic
operations carry no device attribute. The first slice is synchronous: no streams, no async tokens.
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import StringAttr
from xdsl.ir import Dialect, SSAValue
from xdsl.irdl import (
    AnyAttr,
    IRDLOperation,
    VarConstraint,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_attr_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from fhelium.ir.dialects._common import OpenStateType

MEMORY_SPACES = ("default", "pageable_host", "pinned_host")


@irdl_attr_definition
class DeviceType(OpenStateType):
    """A launch-bound execution device (live binding: a `torch.device`)."""

    name = "fhelium_memory.device"


@irdl_op_definition
class TransferOp(IRDLOperation):
    """Move `value` to the `target` device; the result has the same IR type as the input."""

    name = "fhelium_memory.transfer"

    T: ClassVar = VarConstraint("T", AnyAttr())

    value = operand_def(T)
    target = operand_def(DeviceType)
    memory_space = opt_attr_def(StringAttr)
    result = result_def(T)

    traits = traits_def(Pure())

    def __init__(self, value: SSAValue, target: SSAValue, memory_space: str | None = None) -> None:
        attributes = {} if memory_space is None else {"memory_space": StringAttr(memory_space)}
        super().__init__(operands=[value, target], attributes=attributes, result_types=[value.type])

    @property
    def memory_space_name(self) -> str:
        return "default" if self.memory_space is None else self.memory_space.data

    def verify_(self) -> None:
        if self.memory_space_name not in MEMORY_SPACES:
            raise VerifyException(
                "fhelium_memory.transfer memory_space must be 'default', 'pageable_host', or "
                f"'pinned_host'; got {self.memory_space_name!r}"
            )


FHEliumMemory = Dialect("fhelium_memory", [TransferOp], [DeviceType])
