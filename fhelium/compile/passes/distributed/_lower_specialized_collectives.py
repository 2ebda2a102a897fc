"""Rewrite `fhelium_dist.all_reduce_add_ciphertext` into a generic `all_reduce` with a visible add.

Before:
    %sum = "fhelium_dist.all_reduce_add_ciphertext"(%v, %g) : (!ct, !fhelium_dist.group) -> !ct
After:
    %sum = "fhelium_dist.all_reduce"(%v, %g) ({
    ^bb0(%lhs : !ct, %rhs : !ct):
      %s = "fhelium_ckks.add"(%lhs, %rhs) : (!ct, !ct) -> !ct
      "fhelium_dist.yield"(%s) : (!ct) -> ()
    }) : (!ct, !fhelium_dist.group) -> !ct

Callers that bind a whole-operation implementation instead run the pass with
`lower_ciphertext_add=False` (or do not run it); an op already pinned to a Backend implementation
is never lowered silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.ir import Block
from xdsl.pattern_rewriter import (
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from fhelium.compile._pipeline import Diagnostic, Pass, PassError, PassResult, PassStats
from fhelium.compile.passes._operation_transforms import is_traversed, program_operations
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program
from fhelium.ir.dialects import ckks
from fhelium.ir.dialects import distributed as dist


def generic_add_all_reduce(op: dist.AllReduceAddCiphertextOp) -> dist.AllReduceOp:
    """The generic all-reduce equivalent to `op` (not yet inserted)."""
    value_type = op.value.type
    combine = Block(arg_types=[value_type, value_type])
    lhs, rhs = combine.args
    lhs.name_hint, rhs.name_hint = "lhs", "rhs"
    add = ckks.AddOp(lhs, rhs)
    add.result.name_hint = "combined"
    combine.add_ops([add, dist.YieldOp(add.result)])
    return dist.AllReduceOp(op.value, op.group, combine, attributes=dict(op.attributes))


class LowerCiphertextAddAllReduce(RewritePattern):
    """`all_reduce_add_ciphertext` -> `all_reduce` with an `fhelium_ckks.add` combine region."""

    def __init__(self) -> None:
        self.lowered = 0

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: dist.AllReduceAddCiphertextOp, rewriter: PatternRewriter) -> None:
        if not is_traversed(op):
            return
        replacement = generic_add_all_reduce(op)
        replacement.result.name_hint = op.result.name_hint
        rewriter.replace(op, replacement)
        self.lowered += 1


@dataclass(frozen=True)
class LowerSpecializedCollectivesPass(Pass):
    """Lower specialized ciphertext-add all-reduces to generic all-reduces (or keep them)."""

    name: ClassVar[str] = "lower-specialized-collectives"

    lower_ciphertext_add: bool = True

    def run(self, program: Program) -> PassResult:
        matches = [op for op in program_operations(program) if isinstance(op, dist.AllReduceAddCiphertextOp)]
        if not self.lower_ciphertext_add:
            notes = tuple(
                Diagnostic("note", "preserved for a whole-operation implementation", op.name)
                for op in matches
            )
            return PassResult(program, PassStats(matched=len(matches), skipped=len(matches)), notes)
        for op in matches:  # refuse before rewriting anything
            assigned = op.attributes.get(EXECUTION_IMPLEMENTATION_ATTRIBUTE)
            if assigned is not None:
                raise PassError(
                    f"{op.name} requests Backend implementation {assigned}; preserve the operation "
                    f"(lower_ciphertext_add=false) or remove the {EXECUTION_IMPLEMENTATION_ATTRIBUTE} "
                    "assignment before lowering"
                )
        pattern = LowerCiphertextAddAllReduce()
        PatternRewriteWalker(pattern, apply_recursively=False).rewrite_module(program.module)
        count = pattern.lowered
        stats = PassStats(matched=count, transformed=count, inserted=3 * count, removed=count)
        return PassResult(program, stats)
