"""Structured traversal shared by every Compile pass.

Passes see the operations of every function body and descend into the regions whose semantics
fhelium knows: `scf.for`, `scf.if` and the combine region of `fhelium_dist.all_reduce`. Any other
operation that owns regions or successors (a vendor op, `scf.while`, ...) is yielded as ONE opaque
operation and never entered, so a pass cannot rewrite code whose execution model it does not know.
"""

from __future__ import annotations

from collections.abc import Iterator

from xdsl.dialects import func, scf
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation

from fhelium.ir import Program, is_terminator
from fhelium.ir.dialects import distributed as dist

#: Region owners whose regions passes may enter.
KNOWN_REGION_OWNERS: tuple[type[Operation], ...] = (scf.ForOp, scf.IfOp, dist.AllReduceOp)


def is_known_region_owner(op: Operation) -> bool:
    return isinstance(op, KNOWN_REGION_OWNERS)


def is_opaque(op: Operation) -> bool:
    """True for an op that owns regions or successors fhelium does not understand."""
    return not is_known_region_owner(op) and (bool(op.regions) or bool(op.successors))


def block_operations(block: Block) -> Iterator[Operation]:
    """Non-terminator operations of `block` and of known nested regions, in program order.

    A known region owner is yielded after the operations of its regions, so a rewrite of an inner
    operation never invalidates the iteration over the owner itself.
    """
    for op in list(block.ops):
        if is_terminator(op):
            continue  # terminators only return values; passes never need to see them
        if is_known_region_owner(op):
            for region in op.regions:
                for inner in region.blocks:
                    yield from block_operations(inner)
        yield op


def program_operations(program: Program) -> Iterator[Operation]:
    """Every non-terminator operation a pass may inspect, across all functions of `program`."""
    for function in program.functions().values():
        for block in function.body.blocks:
            yield from block_operations(block)


def is_traversed(op: Operation) -> bool:
    """True for an operation `program_operations` yields: a non-terminator in a top-level function,
    possibly inside known region owners, never inside an opaque one. Rewrite patterns check it so a
    pattern walk touches exactly what the structured traversal would.
    """
    if is_terminator(op):
        return False
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, func.FuncOp):
        if not is_known_region_owner(parent):
            return False
        parent = parent.parent_op()
    if parent is None:
        return False
    module = parent.parent_op()
    return isinstance(module, ModuleOp) and module.parent_op() is None


def program_operations_and_known_region_owners(
    program: Program,
) -> tuple[list[Operation], list[Operation]]:
    """(all traversable operations, the subset that own known regions)."""
    operations = list(program_operations(program))
    owners = [op for op in operations if is_known_region_owner(op)]
    return operations, owners


def enclosing_known_owners(op: Operation) -> list[Operation]:
    """The known region owners around `op`, innermost first (stops at the function)."""
    owners: list[Operation] = []
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, func.FuncOp):
        owners.append(parent)
        parent = parent.parent_op()
    return owners
