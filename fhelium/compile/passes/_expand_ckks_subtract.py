"""CKKS lowering: `fhelium_ckks.subtract(a, b)` becomes `fhelium_ckks.add(a, fhelium_ckks.negate(b))`.

Useful for Backends that only register add and negate; applied inside known structured regions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.pattern_rewriter import (
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from fhelium.compile._pipeline import Pass, PassResult, PassStats
from fhelium.compile.passes._operation_transforms import is_traversed
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program
from fhelium.ir.dialects import ckks


class ExpandSubtract(RewritePattern):
    """The rewrite itself; counts what it saw for the pass's stats."""

    def __init__(self) -> None:
        self.matched = 0
        self.transformed = 0

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ckks.SubtractOp, rewriter: PatternRewriter) -> None:
        if not is_traversed(op):
            return
        self.matched += 1
        if EXECUTION_IMPLEMENTATION_ATTRIBUTE in op.attributes:
            return  # pinned to a Backend implementation: keep as written
        negate = ckks.NegateOp(op.rhs)
        add = ckks.AddOp(op.lhs, negate.result)
        add.result.name_hint = op.result.name_hint
        rewriter.replace(op, [negate, add])
        self.transformed += 1


@dataclass(frozen=True)
class ExpandCiphertextSubtractPass(Pass):
    name: ClassVar[str] = "expand-ckks-subtract"

    def run(self, program: Program) -> PassResult:
        pattern = ExpandSubtract()
        PatternRewriteWalker(pattern, apply_recursively=False).rewrite_module(program.module)
        stats = PassStats(
            matched=pattern.matched,
            transformed=pattern.transformed,
            skipped=pattern.matched - pattern.transformed,
            inserted=2 * pattern.transformed,
            removed=pattern.transformed,
        )
        return PassResult(program, stats)
