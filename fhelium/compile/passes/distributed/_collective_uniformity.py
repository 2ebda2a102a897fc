"""Opt-in analysis: find collectives that some ranks may reach while others do not.

Structural verification accepts such Programs (the IR is permissive on purpose); this pass reports
them before launch, where a mismatch would otherwise hang every rank inside Gloo or NCCL.

A value is *rank-dependent* when it is computed, directly or through any operation, from
`fhelium_dist.rank`; collective results (broadcast, all-reduce) are the same on every rank again.
A collective is flagged when it sits under an `scf.if` with a rank-dependent condition or inside an
`scf.for` whose trip count may depend on the rank. A loop `[lo, lo + n)` with rank-dependent `lo`
but uniform `n` and step is recognised as uniform, since that is how ranks select their own
interval. Collectives hidden inside opaque region owners get a warning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from xdsl.dialects import arith, scf
from xdsl.ir import Block, Operation, SSAValue

from fhelium.compile._pipeline import Diagnostic, Pass, PassResult, PassStats
from fhelium.compile.passes._operation_transforms import is_opaque
from fhelium.ir import Program, operation_name
from fhelium.ir.dialects import distributed as dist

COLLECTIVES: tuple[type[Operation], ...] = (
    dist.BroadcastOp,
    dist.AllReduceOp,
    dist.AllReduceAddCiphertextOp,
)

#: Operations whose result is the same on every rank, whatever their operands.
UNIFORM_RESULTS: tuple[type[Operation], ...] = (*COLLECTIVES, dist.GroupSizeOp)


@dataclass
class _Analysis:
    rank_dependent: set[SSAValue] = field(default_factory=set[SSAValue])
    diagnostics: list[Diagnostic] = field(default_factory=list[Diagnostic])
    collectives: int = 0

    def depends(self, value: SSAValue) -> bool:
        return value in self.rank_dependent

    def mark(self, values: Iterable[SSAValue]) -> bool:
        """Mark values rank-dependent; True if anything new was marked."""
        changed = False
        for value in values:
            if value not in self.rank_dependent:
                self.rank_dependent.add(value)
                changed = True
        return changed

    def uniform_trip_count(self, loop: scf.ForOp) -> bool:
        if self.depends(loop.step):
            return False
        if not self.depends(loop.lb) and not self.depends(loop.ub):
            return True
        upper = loop.ub.owner
        if isinstance(upper, arith.AddiOp):
            lhs, rhs = upper.lhs, upper.rhs
            if lhs == loop.lb and not self.depends(rhs):
                return True
            if rhs == loop.lb and not self.depends(lhs):
                return True
        return False

    def visit_block(self, block: Block, divergent: list[str]) -> None:
        for op in block.ops:
            self.visit(op, divergent)

    def visit(self, op: Operation, divergent: list[str]) -> None:
        if isinstance(op, COLLECTIVES):
            self.collectives += 1
            if divergent:
                self.diagnostics.append(
                    Diagnostic(
                        "error",
                        f"{op.name} may be reached by some ranks and not others: " + "; ".join(divergent),
                        op.name,
                    )
                )
        if isinstance(op, dist.RankOp):
            self.mark(op.results)
            return
        if isinstance(op, scf.ForOp):
            self._visit_for(op, divergent)
            return
        if isinstance(op, scf.IfOp):
            self._visit_if(op, divergent)
            return
        if is_opaque(op):
            hidden = [inner.name for inner in op.walk() if isinstance(inner, COLLECTIVES)]
            if hidden:
                self.diagnostics.append(
                    Diagnostic(
                        "warning",
                        f"{operation_name(op)} owns regions this analysis cannot enter and contains "
                        f"collectives ({', '.join(hidden)}); their uniformity is not checked",
                        operation_name(op),
                    )
                )
        for region in op.regions:
            for inner in region.blocks:
                self.visit_block(inner, divergent)
        if isinstance(op, UNIFORM_RESULTS):
            return  # every rank receives the same value
        if any(self.depends(operand) for operand in op.operands):
            self.mark(op.results)

    def _visit_for(self, loop: scf.ForOp, divergent: list[str]) -> None:
        body = loop.body.block
        if self.depends(loop.lb) or self.depends(loop.step):
            self.mark([body.args[0]])
        for init, carried in zip(loop.iter_args, body.args[1:], strict=True):
            if self.depends(init):
                self.mark([carried])
        inner = (
            divergent if self.uniform_trip_count(loop) else [*divergent, "scf.for trip count depends on rank"]
        )
        # Iterate to a fixpoint so rank dependence that flows through iter_args is seen.
        while True:
            before = len(self.rank_dependent)
            saved = len(self.diagnostics)
            self.visit_block(body, inner)
            yielded = body.last_op.operands if body.last_op is not None else ()
            for value, carried, result in zip(yielded, body.args[1:], loop.results, strict=True):
                if self.depends(value):
                    self.mark([carried, result])
            if len(self.rank_dependent) == before:
                break
            del self.diagnostics[saved:]
            self.collectives -= sum(1 for op in body.walk() if isinstance(op, COLLECTIVES))

    def _visit_if(self, branch: scf.IfOp, divergent: list[str]) -> None:
        inner = [*divergent, "scf.if condition depends on rank"] if self.depends(branch.cond) else divergent
        for region in branch.regions:
            for block in region.blocks:
                self.visit_block(block, inner)
                last = block.last_op
                if last is not None:
                    for value, result in zip(last.operands, branch.results, strict=False):
                        if self.depends(value):
                            self.mark([result])
        if self.depends(branch.cond):
            self.mark(branch.results)


@dataclass(frozen=True)
class CheckCollectiveUniformityPass(Pass):
    """Report collectives whose execution may differ between ranks. Does not change the Program."""

    name: ClassVar[str] = "check-collective-uniformity"

    def run(self, program: Program) -> PassResult:
        analysis = _Analysis()
        for function in program.functions().values():
            for block in function.body.blocks:
                analysis.visit_block(block, [])
        flagged = sum(1 for d in analysis.diagnostics if d.severity == "error")
        stats = PassStats(matched=analysis.collectives, skipped=min(flagged, analysis.collectives))
        return PassResult(program, stats, tuple(analysis.diagnostics))
