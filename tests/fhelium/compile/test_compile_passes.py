"""Structured traversal, CKKS lowering, implementation assignment, and the pass pipeline."""

from __future__ import annotations

import pytest

from fhelium.compile import PassError, PassStats, Pipeline, create_pass, pass_names
from fhelium.compile.passes import (
    AssignImplementationsPass,
    ExpandCiphertextSubtractPass,
    program_operations,
    program_operations_and_known_region_owners,
)
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program, operation_name

CT = "!fhelium_ckks.ciphertext<{depth = 0 : i64}>"
BIN = f"({CT}, {CT}) -> {CT}"

# A subtract at top level, inside scf.for, inside scf.if, inside an all_reduce combine region, and
# inside an opaque vendor region owner.
STRUCTURED = f"""builtin.module {{
  func.func @main(%x: {CT}, %n: index, %flag: i1) -> {CT} {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %top = "fhelium_ckks.subtract"(%x, %x) : {BIN}
    %loop = scf.for %i = %c0 to %n step %c1 iter_args(%a = %top) -> ({CT}) {{
      %in_loop = "fhelium_ckks.subtract"(%a, %x) : {BIN}
      scf.yield %in_loop : {CT}
    }}
    %branch = scf.if %flag -> ({CT}) {{
      %in_then = "fhelium_ckks.subtract"(%loop, %x) : {BIN}
      scf.yield %in_then : {CT}
    }} else {{
      scf.yield %loop : {CT}
    }}
    %reduced = "fhelium_dist.all_reduce"(%branch, %g) ({{
    ^bb0(%lhs: {CT}, %rhs: {CT}):
      %in_combine = "fhelium_ckks.subtract"(%lhs, %rhs) : {BIN}
      "fhelium_dist.yield"(%in_combine) : ({CT}) -> ()
    }}) : ({CT}, !fhelium_dist.group) -> {CT}
    %vendor = "vendor.region_owner"(%reduced) ({{
    ^bb0(%v: {CT}):
      %in_vendor = "fhelium_ckks.subtract"(%v, %v) : {BIN}
      "vendor.yield"(%in_vendor) : ({CT}) -> ()
    }}) : ({CT}) -> {CT}
    func.return %vendor : {CT}
  }}
}}
"""


def _hints(program: Program, name: str) -> list[str]:
    return [op.results[0].name_hint or "" for op in program_operations(program) if op.name == name]


def test_traversal_enters_known_regions_and_keeps_vendor_owner_opaque() -> None:
    program = Program.parse(STRUCTURED)
    assert _hints(program, "fhelium_ckks.subtract") == ["top", "in_loop", "in_then", "in_combine"]
    names = [operation_name(op) for op in program_operations(program)]
    assert "vendor.region_owner" in names
    assert not any(name in names for name in ("scf.yield", "fhelium_dist.yield", "func.return"))
    _, owners = program_operations_and_known_region_owners(program)
    assert [op.name for op in owners] == ["scf.for", "scf.if", "fhelium_dist.all_reduce"]


def test_expand_subtract_lowers_inside_structured_regions_only() -> None:
    program = Program.parse(STRUCTURED)
    lowered, (result,) = Pipeline([ExpandCiphertextSubtractPass()]).run(program)
    assert result.stats == PassStats(matched=4, transformed=4, inserted=8, removed=4)
    assert _hints(lowered, "fhelium_ckks.subtract") == []
    assert _hints(lowered, "fhelium_ckks.add") == ["top", "in_loop", "in_then", "in_combine"]
    assert len(_hints(lowered, "fhelium_ckks.negate")) == 4
    vendor = next(op for op in lowered.walk() if operation_name(op) == "vendor.region_owner")
    vendor_ops = [operation_name(op) for op in vendor.walk()][1:]
    assert vendor_ops == ["fhelium_ckks.subtract", "vendor.yield"]
    # The input Program is untouched: the pipeline works on a clone.
    assert _hints(program, "fhelium_ckks.subtract") == ["top", "in_loop", "in_then", "in_combine"]


def test_expand_subtract_keeps_pinned_operations() -> None:
    program = Program.parse(STRUCTURED)
    assigned, _ = Pipeline([AssignImplementationsPass({"fhelium_ckks.subtract": "vendor-sub"})]).run(program)
    lowered, (result,) = Pipeline([ExpandCiphertextSubtractPass()]).run(assigned)
    assert result.stats == PassStats(matched=4, skipped=4)
    assert len(_hints(lowered, "fhelium_ckks.subtract")) == 4


def test_assign_implementations_reaches_structured_regions_and_respects_existing_choice() -> None:
    program = Program.parse(STRUCTURED)
    first, (result,) = Pipeline([AssignImplementationsPass({"fhelium_ckks.subtract": "torch-rns-subtract"})]).run(
        program
    )
    assert result.stats == PassStats(matched=4, transformed=4)
    chosen = [
        op.attributes[EXECUTION_IMPLEMENTATION_ATTRIBUTE].data  # type: ignore[attr-defined]
        for op in program_operations(first)
        if op.name == "fhelium_ckks.subtract"
    ]
    assert chosen == ["torch-rns-subtract"] * 4
    inside_vendor = next(op for op in first.walk() if op.results and op.results[0].name_hint == "in_vendor")
    assert EXECUTION_IMPLEMENTATION_ATTRIBUTE not in inside_vendor.attributes
    second, (again,) = Pipeline([AssignImplementationsPass({"fhelium_ckks.subtract": "other"})]).run(first)
    assert again.stats == PassStats(matched=4, skipped=4)
    assert second.to_text() == first.to_text()
    text = first.to_text()
    assert Program.parse(text).to_text() == text
    assert 'fhelium.execution.implementation = "torch-rns-subtract"' in text


def test_pass_registry_builds_passes_by_name_with_checked_options() -> None:
    assert {"lower-specialized-collectives", "check-collective-uniformity", "expand-ckks-subtract",
            "assign-implementations"} <= set(pass_names())
    with pytest.raises(PassError, match="unknown pass 'nope'; known passes: "):
        create_pass("nope")
    with pytest.raises(PassError, match="has no option"):
        create_pass("lower-specialized-collectives", {"bogus": "1"})
    with pytest.raises(PassError, match="must be true or false"):
        create_pass("lower-specialized-collectives", {"lower_ciphertext_add": "maybe"})


def test_pass_stats_reject_impossible_counts() -> None:
    with pytest.raises(PassError, match="exceeds matched"):
        PassStats(matched=1, transformed=1, skipped=1)
