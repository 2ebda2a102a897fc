"""CKKS lowering: `fhelium_ckks.subtract(a, b)` becomes `fhelium_ckks.add(a, fhelium_ckks.negate(b))`.

Useful for Backends that only register add and negate; applied inside known structured regions.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.rewriter import InsertPoint, Rewriter

from fhelium.compile._pipeline import PassResult, PassStats, register_pass, reject_unknown_options
from fhelium.compile.passes._operation_transforms import program_operations
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program
from fhelium.ir.dialects import ckks


@dataclass(frozen=True)
class ExpandCiphertextSubtractPass:
    name: str = "expand-ckks-subtract"

    def run(self, program: Program) -> PassResult:
        matches = [op for op in program_operations(program) if isinstance(op, ckks.SubtractOp)]
        transformed = 0
        for op in matches:
            if EXECUTION_IMPLEMENTATION_ATTRIBUTE in op.attributes:
                continue  # pinned to a Backend implementation: keep as written
            negate = ckks.NegateOp(op.rhs)
            Rewriter.insert_op(negate, InsertPoint.before(op))
            add = ckks.AddOp(op.lhs, negate.result)
            add.result.name_hint = op.result.name_hint
            Rewriter.replace_op(op, add)
            transformed += 1
        stats = PassStats(
            matched=len(matches),
            transformed=transformed,
            skipped=len(matches) - transformed,
            inserted=2 * transformed,
            removed=transformed,
        )
        return PassResult(program, stats)


def _factory(options: dict[str, str]) -> ExpandCiphertextSubtractPass:
    reject_unknown_options("expand-ckks-subtract", options, [])
    return ExpandCiphertextSubtractPass()


register_pass("expand-ckks-subtract", _factory)
