"""Structured traversal shared by every Compile pass.

Passes see the operations of every function body and descend into the regions whose semantics
fhelium knows: `scf.for`, `scf.if` and the combine region of `fhelium_dist.all_reduce`. Any other
operation that owns regions or successors (a vendor op, `scf.while`, ...) is yielded as ONE opaque
operation and never entered, so a pass cannot rewrite code whose execution model it does not know.
"""

from __future__ import annotations

from collections.abc import Iterator

from xdsl.dialects import func, scf
from xdsl.ir import Block, Operation

from fhelium.ir import Program
from fhelium.ir.dialects import distributed as dist

#: Region owners whose regions passes may enter.
KNOWN_REGION_OWNERS: tuple[type[Operation], ...] = (scf.ForOp, scf.IfOp, dist.AllReduceOp)

#: Terminators that only return values; passes never need to see them.
_TERMINATORS: tuple[type[Operation], ...] = (func.ReturnOp, scf.YieldOp, dist.YieldOp)


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
        if isinstance(op, _TERMINATORS):
            continue
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
