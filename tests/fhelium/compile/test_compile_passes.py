"""Structured traversal, CKKS lowering, implementation assignment, and the pass pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from xdsl.passes import ModulePass, PassPipeline
from xdsl.utils.arg_spec import ArgSpec

from fhelium.compile import (
    Pass,
    PassError,
    PassResult,
    PassStats,
    Pipeline,
    _registry,
    create_pass,
    pass_names,
    register_pass,
)
from fhelium.compile.passes import (
    BUILTIN_PASSES,
    AssignImplementationsPass,
    CheckCollectiveUniformityPass,
    ExpandCiphertextSubtractPass,
    LowerSpecializedCollectivesPass,
    program_operations,
    program_operations_and_known_region_owners,
)
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program, create_dialect_context, operation_name

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
    first, (result,) = Pipeline(
        [AssignImplementationsPass({"fhelium_ckks.subtract": "torch-rns-subtract"})]
    ).run(program)
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
    assert {
        "lower-specialized-collectives",
        "check-collective-uniformity",
        "expand-ckks-subtract",
        "assign-implementations",
    } <= set(pass_names())
    with pytest.raises(PassError, match="unknown pass 'nope'; known passes: "):
        create_pass("nope")
    with pytest.raises(PassError, match="has no option"):
        create_pass("lower-specialized-collectives", {"bogus": "1"})
    with pytest.raises(PassError, match="must be true or false"):
        create_pass("lower-specialized-collectives", {"lower_ciphertext_add": "maybe"})


def test_pass_stats_reject_impossible_counts() -> None:
    with pytest.raises(PassError, match="exceeds matched"):
        PassStats(matched=1, transformed=1, skipped=1)


def test_every_builtin_pass_is_known_by_its_one_name() -> None:
    assert set(pass_names()) >= {each.name for each in BUILTIN_PASSES}
    for each in BUILTIN_PASSES:
        assert type(create_pass(each.name)) is each
        assert issubclass(each, ModulePass)


def test_passes_run_as_xdsl_module_passes_in_an_xdsl_pipeline() -> None:
    program = Program.parse(STRUCTURED)
    spec = ArgSpec("expand-ckks-subtract", {})
    PassPipeline((ExpandCiphertextSubtractPass.from_pass_spec(spec),)).apply(
        create_dialect_context(), program.module
    )
    program.verify()
    # The same four subtracts as through Pipeline; the one inside the vendor op stays.
    assert [operation_name(op) for op in program.walk()].count("fhelium_ckks.subtract") == 1
    lowered = LowerSpecializedCollectivesPass.from_pass_spec(
        ArgSpec("lower-specialized-collectives", {"lower_ciphertext_add": (False,)})
    )
    assert lowered == LowerSpecializedCollectivesPass(lower_ciphertext_add=False)


def test_an_error_diagnostic_fails_the_pass_under_xdsl() -> None:
    ct = "!fhelium_ckks.ciphertext<{depth = 0 : i64}>"
    divergent = Program.parse(f"""builtin.module {{
  func.func @main(%x: {ct}) -> {ct} {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %c0 = arith.constant 0 : index
    %root = arith.cmpi eq, %r, %c0 : index
    %y = scf.if %root -> ({ct}) {{
      %s = "fhelium_dist.all_reduce_add_ciphertext"(%x, %g) : ({ct}, !fhelium_dist.group) -> {ct}
      scf.yield %s : {ct}
    }} else {{
      scf.yield %x : {ct}
    }}
    func.return %y : {ct}
  }}
}}
""")
    with pytest.raises(PassError, match=r"scf\.if condition depends on rank"):
        CheckCollectiveUniformityPass().apply(create_dialect_context(), divergent.module)


def test_register_pass_adds_a_pass_class_by_its_name() -> None:
    @dataclass(frozen=True)
    class CountOps(Pass):
        name: ClassVar[str] = "test-count-ops"

        limit: int = 0

        def run(self, program: Program) -> PassResult:
            return PassResult(program, PassStats(matched=sum(1 for _ in program_operations(program))))

    register_pass(CountOps)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_pass(CountOps)
        assert "test-count-ops" in pass_names()
        assert create_pass("test-count-ops", {"limit": "3"}) == CountOps(limit=3)
        with pytest.raises(PassError, match="must be an integer"):
            create_pass("test-count-ops", {"limit": "many"})
    finally:
        _registry._BY_NAME.pop("test-count-ops")  # the registry is process-wide
