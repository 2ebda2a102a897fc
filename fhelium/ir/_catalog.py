"""The dialect catalog: which dialects a fhelium Program may use, and the context that loads them."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.arith import Arith
from xdsl.dialects.builtin import Builtin, UnregisteredOp
from xdsl.dialects.func import Func
from xdsl.dialects.scf import Scf
from xdsl.ir import Dialect, Operation
from xdsl.traits import IsTerminator

from fhelium.ir.dialects.ckks import FHEliumCkks
from fhelium.ir.dialects.core import FHElium
from fhelium.ir.dialects.distributed import FHEliumDistributed
from fhelium.ir.dialects.memory import FHEliumMemory

#: fhelium's own dialects, in registration order.
REGISTERED_DIALECTS: tuple[Dialect, ...] = (FHElium, FHEliumCkks, FHEliumDistributed, FHEliumMemory)

#: Upstream xDSL dialects loaded alongside (module/function structure, scalar index math, control flow).
UPSTREAM_DIALECTS: tuple[Dialect, ...] = (Builtin, Func, Arith, Scf)

#: Attribute a pass or caller sets to pin an operation to one named Backend implementation.
EXECUTION_IMPLEMENTATION_ATTRIBUTE = "fhelium.execution.implementation"


def create_dialect_context(*, allow_unregistered: bool = True) -> Context:
    """A Context with every catalog dialect loaded.

    Unregistered operations are allowed by default so foreign (vendor) operations survive parsing
    and printing; they stay opaque to fhelium passes.
    """
    context = Context(allow_unregistered=allow_unregistered)
    for dialect in (*UPSTREAM_DIALECTS, *REGISTERED_DIALECTS):
        context.load_dialect(dialect)
    return context


def registered_dialect_names() -> tuple[str, ...]:
    """Names of fhelium's dialects in registration order."""
    return tuple(dialect.name for dialect in REGISTERED_DIALECTS)


def operation_name(op: Operation) -> str:
    """The textual name of `op`, including for unregistered (vendor) operations."""
    if isinstance(op, UnregisteredOp):
        return op.op_name.data
    return op.name


def is_terminator(op: Operation) -> bool:
    """True for a registered terminator (`func.return`, `scf.yield`, `fhelium_dist.yield`, ...).

    Terminators only hand values back to the region owner. An unregistered (vendor) operation is
    never taken for one: xDSL answers "yes" to any trait query on those.
    """
    return op.has_trait(IsTerminator, value_if_unregistered=False)
