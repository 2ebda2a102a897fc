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

from xdsl.ir import Block
from xdsl.rewriter import Rewriter

from fhelium.compile._pipeline import (
    Diagnostic,
    PassError,
    PassResult,
    PassStats,
    parse_bool_option,
    register_pass,
    reject_unknown_options,
)
from fhelium.compile.passes._operation_transforms import program_operations
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


@dataclass(frozen=True)
class LowerSpecializedCollectivesPass:
    """Lower specialized ciphertext-add all-reduces to generic all-reduces (or keep them)."""

    lower_ciphertext_add: bool = True
    name: str = "lower-specialized-collectives"

    def run(self, program: Program) -> PassResult:
        matches = [op for op in program_operations(program) if isinstance(op, dist.AllReduceAddCiphertextOp)]
        if not self.lower_ciphertext_add:
            notes = tuple(
                Diagnostic("note", "preserved for a whole-operation implementation", op.name) for op in matches
            )
            return PassResult(program, PassStats(matched=len(matches), skipped=len(matches)), notes)
        for op in matches:
            assigned = op.attributes.get(EXECUTION_IMPLEMENTATION_ATTRIBUTE)
            if assigned is not None:
                raise PassError(
                    f"{op.name} requests Backend implementation {assigned}; preserve the operation "
                    f"(lower_ciphertext_add=false) or remove the {EXECUTION_IMPLEMENTATION_ATTRIBUTE} "
                    "assignment before lowering"
                )
        for op in matches:
            replacement = generic_add_all_reduce(op)
            replacement.result.name_hint = op.result.name_hint
            Rewriter.replace_op(op, replacement)
        count = len(matches)
        stats = PassStats(matched=count, transformed=count, inserted=3 * count, removed=count)
        return PassResult(program, stats)


def _factory(options: dict[str, str]) -> LowerSpecializedCollectivesPass:
    name = "lower-specialized-collectives"
    reject_unknown_options(name, options, ["lower_ciphertext_add"])
    lower = parse_bool_option(name, "lower_ciphertext_add", options.get("lower_ciphertext_add", "true"))
    return LowerSpecializedCollectivesPass(lower_ciphertext_add=lower)


register_pass("lower-specialized-collectives", _factory)
