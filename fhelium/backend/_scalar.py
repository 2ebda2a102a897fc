"""Host-side scalar arithmetic for `arith` operations on index/integer/float values.

Values are Python ints (index, iN), bools (i1) or floats; a one-element tensor is accepted wherever
a scalar is expected, so a rank query's tensor result can feed loop bounds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from xdsl.dialects import arith
from xdsl.dialects.builtin import FloatAttr, IntegerAttr, IntegerType
from xdsl.ir import Attribute, Operation


class ScalarError(TypeError):
    """An arith operation received something that is not a host scalar."""


def as_scalar(op_name: str, value: object) -> int | float | bool:
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        item = value.item()
        assert isinstance(item, bool | int | float)
        return item
    raise ScalarError(
        f"{op_name} executes on host scalars (index, integer, float); got {type(value).__name__}"
        + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
    )


def _trunc_div(lhs: int, rhs: int) -> int:
    if rhs == 0:
        raise ZeroDivisionError("arith division by zero")
    quotient = abs(lhs) // abs(rhs)
    return quotient if (lhs >= 0) == (rhs >= 0) else -quotient


def _trunc_rem(lhs: int, rhs: int) -> int:
    return lhs - rhs * _trunc_div(lhs, rhs)


def _ceil_div(lhs: int, rhs: int) -> int:
    return -((-lhs) // rhs)


BINARY: dict[type[Operation], Callable[[Any, Any], Any]] = {
    arith.AddiOp: operator.add,
    arith.SubiOp: operator.sub,
    arith.MuliOp: operator.mul,
    arith.DivUIOp: _trunc_div,
    arith.DivSIOp: _trunc_div,
    arith.FloorDivSIOp: operator.floordiv,
    arith.CeilDivSIOp: _ceil_div,
    arith.RemUIOp: _trunc_rem,
    arith.RemSIOp: _trunc_rem,
    arith.MinUIOp: min,
    arith.MaxUIOp: max,
    arith.MinSIOp: min,
    arith.MaxSIOp: max,
    arith.AndIOp: operator.and_,
    arith.OrIOp: operator.or_,
    arith.XOrIOp: operator.xor,
    arith.AddfOp: operator.add,
    arith.SubfOp: operator.sub,
    arith.MulfOp: operator.mul,
    arith.DivfOp: operator.truediv,
}

#: arith.cmpi predicates by their MLIR number (signed and unsigned agree on index values >= 0).
COMPARISONS: dict[int, Callable[[Any, Any], bool]] = {
    0: operator.eq,
    1: operator.ne,
    2: operator.lt,
    3: operator.le,
    4: operator.gt,
    5: operator.ge,
    6: operator.lt,
    7: operator.le,
    8: operator.gt,
    9: operator.ge,
}


def constant_value(op: arith.ConstantOp) -> int | float | bool:
    value: Attribute = op.value
    if isinstance(value, IntegerAttr):
        number = int(value.value.data)
        if isinstance(op.result.type, IntegerType) and op.result.type.width.data == 1:
            return bool(number)
        return number
    if isinstance(value, FloatAttr):
        return float(value.value.data)
    raise ScalarError(f"arith.constant with {value} is not a host scalar; only integer/float constants run")


def evaluate(op: Operation, operands: list[Any]) -> object:
    """The single result of a scalar arith op, or raise ScalarError if `op` is not one."""
    scalars = [as_scalar(op.name, value) for value in operands]
    handler = BINARY.get(type(op))
    if handler is not None:
        return handler(scalars[0], scalars[1])
    if isinstance(op, arith.CmpiOp):
        predicate = int(op.predicate.value.data)
        return COMPARISONS[predicate](scalars[0], scalars[1])
    if isinstance(op, arith.SelectOp):
        return operands[1] if scalars[0] else operands[2]
    if isinstance(op, arith.IndexCastOp):
        return int(scalars[0])
    raise ScalarError(f"{op.name} is not a supported scalar arith operation")


def is_scalar_arith(op: Operation) -> bool:
    return type(op) in BINARY or isinstance(op, arith.CmpiOp | arith.SelectOp | arith.IndexCastOp)
