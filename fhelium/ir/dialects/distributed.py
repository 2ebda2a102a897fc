"""The `fhelium_dist` dialect: rank-local collectives over a launch-bound process group.

A Program written in this dialect describes ONE rank. `fhelium_dist.rank` and `.group_size` read
the group-relative identity at launch, so one textual Program serves every rank. Verification is
structural only: it does not prove that ranks reach matching collective sequences, that a combine
region is associative, or that the Program cannot deadlock (see the opt-in analysis passes).
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import IndexType, IntegerAttr, IntegerType
from xdsl.ir import Attribute, Block, Dialect, Region, SSAValue
from xdsl.irdl import (
    AnyAttr,
    IRDLOperation,
    VarConstraint,
    attr_def,
    base,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    region_def,
    result_def,
    traits_def,
)
from xdsl.traits import IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from fhelium.ir.dialects._common import OpenStateType
from fhelium.ir.dialects.ckks import CiphertextType


@irdl_attr_definition
class GroupType(OpenStateType):
    """A process group bound at launch (live binding: `ProcessGroupExecutionResource`)."""

    name = "fhelium_dist.group"


class _GroupQueryOp(IRDLOperation):
    """Reads one index from the launch-bound `group`; the same on every call (Pure)."""

    group = operand_def(GroupType)
    result = result_def(IndexType)
    traits = traits_def(Pure())

    def __init__(self, group: SSAValue) -> None:
        super().__init__(operands=[group], result_types=[IndexType()])


@irdl_op_definition
class RankOp(_GroupQueryOp):
    """The calling process's rank relative to `group` (not the global rank, not a CUDA index)."""

    name = "fhelium_dist.rank"


@irdl_op_definition
class GroupSizeOp(_GroupQueryOp):
    """The number of ranks participating in `group`."""

    name = "fhelium_dist.group_size"


@irdl_op_definition
class BroadcastOp(IRDLOperation):
    """Functional broadcast: every rank's result is the `root` rank's value (`root` is group-relative)."""

    name = "fhelium_dist.broadcast"

    T: ClassVar = VarConstraint("T", AnyAttr())

    value = operand_def(T)
    group = operand_def(GroupType)
    root = attr_def(IntegerAttr)
    result = result_def(T)

    def __init__(self, value: SSAValue, group: SSAValue, root: int) -> None:
        super().__init__(
            operands=[value, group],
            attributes={"root": IntegerAttr(root, IntegerType(64))},
            result_types=[value.type],
        )

    def verify_(self) -> None:
        if int(self.root.value.data) < 0:
            raise VerifyException(f"fhelium_dist.broadcast root must be >= 0; got {self.root.value.data}")


@irdl_op_definition
class YieldOp(IRDLOperation):
    """Return the combined value from an `all_reduce` combine region."""

    name = "fhelium_dist.yield"

    value = operand_def()
    traits = traits_def(IsTerminator())

    def __init__(self, value: SSAValue) -> None:
        super().__init__(operands=[value])


@irdl_op_definition
class AllReduceOp(IRDLOperation):
    """Reduce every rank's `value` with the visible two-argument `combine` region.

    The region takes (accumulator, next) of the value type and yields their combination with
    `fhelium_dist.yield`. The Backend folds contributions in group-rank order, so a combine that is
    not associative still gives every rank the same answer.
    """

    name = "fhelium_dist.all_reduce"

    T: ClassVar = VarConstraint("T", AnyAttr())

    value = operand_def(T)
    group = operand_def(GroupType)
    result = result_def(T)
    combine = region_def("single_block")

    def __init__(
        self,
        value: SSAValue,
        group: SSAValue,
        combine: Region | Block,
        attributes: dict[str, Attribute] | None = None,
    ) -> None:
        region = combine if isinstance(combine, Region) else Region(combine)
        super().__init__(
            operands=[value, group],
            result_types=[value.type],
            regions=[region],
            attributes=attributes or {},
        )

    def verify_(self) -> None:
        value_type = self.value.type
        blocks = list(self.combine.blocks)
        if len(blocks) != 1:
            raise VerifyException(
                f"fhelium_dist.all_reduce combine region must have exactly one block; got {len(blocks)}"
            )
        block = blocks[0]
        arg_types = [arg.type for arg in block.args]
        if arg_types != [value_type, value_type]:
            raise VerifyException(
                "fhelium_dist.all_reduce combine arguments must match the reduced value type: expected "
                f"two arguments of {value_type}, got ({', '.join(str(t) for t in arg_types)})"
            )
        last = block.last_op
        if not isinstance(last, YieldOp):
            raise VerifyException("fhelium_dist.all_reduce combine region must end with fhelium_dist.yield")
        if last.value.type != value_type:
            raise VerifyException(
                f"fhelium_dist.yield in a combine region must yield {value_type}; got {last.value.type}"
            )


@irdl_op_definition
class AllReduceAddCiphertextOp(IRDLOperation):
    """Ciphertext-sum all-reduce, kept whole so a Backend may bind one specialized implementation.

    `LowerSpecializedCollectivesPass` rewrites it into `fhelium_dist.all_reduce` with a visible
    `fhelium_ckks.add` combine region.
    """

    name = "fhelium_dist.all_reduce_add_ciphertext"

    T: ClassVar = VarConstraint("T", base(CiphertextType))

    value = operand_def(T)
    group = operand_def(GroupType)
    result = result_def(T)

    def __init__(self, value: SSAValue, group: SSAValue) -> None:
        super().__init__(operands=[value, group], result_types=[value.type])


FHEliumDistributed = Dialect(
    "fhelium_dist",
    [RankOp, GroupSizeOp, BroadcastOp, AllReduceOp, AllReduceAddCiphertextOp, YieldOp],
    [GroupType],
)
