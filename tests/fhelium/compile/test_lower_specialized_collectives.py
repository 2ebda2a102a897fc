"""LowerSpecializedCollectivesPass: FileCheck-style expected output, preserve mode, and refusal."""

from __future__ import annotations

import re

import pytest

from fhelium.compile import PassError, PassStats, Pipeline, create_pass
from fhelium.compile.passes import LowerSpecializedCollectivesPass, program_operations
from fhelium.ir import Program

CT = "!fhelium_ckks.ciphertext<{depth = 0 : i64}>"

INPUT = f"""
// RUN: fhelium-opt %s -p lower-specialized-collectives
builtin.module {{
  func.func @main(%x: {CT}, %n: index) -> {CT} {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %looped = scf.for %i = %c0 to %n step %c1 iter_args(%a = %x) -> ({CT}) {{
      %inner = "fhelium_dist.all_reduce_add_ciphertext"(%a, %g) : ({CT}, !fhelium_dist.group) -> {CT}
      scf.yield %inner : {CT}
    }}
    %sum = "fhelium_dist.all_reduce_add_ciphertext"(%looped, %g) {{note = "kept"}}
        : ({CT}, !fhelium_dist.group) -> {CT}
    func.return %sum : {CT}
  }}
}}
"""

EXPECTED = f"""
// CHECK:      %looped = scf.for %i = %c0 to %n step %c1 iter_args(%a = %x) -> ({CT}) {{
// CHECK-NEXT:   %inner = "fhelium_dist.all_reduce"(%a, %g) ({{
// CHECK-NEXT:   ^bb0(%lhs: {CT}, %rhs: {CT}):
// CHECK-NEXT:     %combined = "fhelium_ckks.add"(%lhs, %rhs) : ({CT}, {CT}) -> {CT}
// CHECK-NEXT:     "fhelium_dist.yield"(%combined) : ({CT}) -> ()
// CHECK-NEXT:   }}) : ({CT}, !fhelium_dist.group) -> {CT}
// CHECK-NEXT:   scf.yield %inner : {CT}
// CHECK:      %sum = "fhelium_dist.all_reduce"(%looped, %g) ({{
// CHECK:      }}) {{note = "kept"}} : ({CT}, !fhelium_dist.group) -> {CT}
// CHECK-NEXT: func.return %sum : {CT}
// CHECK-NOT:  all_reduce_add_ciphertext
"""


def filecheck(output: str, checks: str) -> None:
    """A small FileCheck: CHECK (in order), CHECK-NEXT (next line), CHECK-NOT (nowhere after)."""
    lines = [line.strip() for line in output.splitlines()]
    position = 0
    for raw in checks.strip().splitlines():
        match = re.match(r"//\s*(CHECK(?:-NEXT|-NOT)?):\s*(.*)$", raw.strip())
        assert match, f"malformed check line {raw!r}"
        kind, pattern = match.group(1), match.group(2).strip()
        if kind == "CHECK-NOT":
            assert not any(pattern in line for line in lines[position:]), f"unexpected {pattern!r}"
        elif kind == "CHECK-NEXT":
            assert position < len(lines) and pattern in lines[position], (
                f"CHECK-NEXT {pattern!r} does not match line {position}: "
                f"{lines[position] if position < len(lines) else 'EOF'!r}"
            )
            position += 1
        else:
            for index in range(position, len(lines)):
                if pattern in lines[index]:
                    position = index + 1
                    break
            else:
                raise AssertionError(f"CHECK {pattern!r} not found after line {position}:\n{output}")


def test_specialized_all_reduce_becomes_generic_with_visible_add() -> None:
    program = Program.parse(INPUT)
    lowered, (result,) = Pipeline([create_pass("lower-specialized-collectives")]).run(program)
    assert result.stats == PassStats(matched=2, transformed=2, inserted=6, removed=2)
    filecheck(lowered.to_text(), EXPECTED)
    text = lowered.to_text()
    assert Program.parse(text).to_text() == text


def test_filecheck_helper_detects_a_mismatch() -> None:
    with pytest.raises(AssertionError):
        filecheck("a\nb\n", "// CHECK: a\n// CHECK-NEXT: c")
    with pytest.raises(AssertionError):
        filecheck("a\nb\n", "// CHECK: a\n// CHECK-NOT: b")


def test_preserve_mode_keeps_the_specialized_operation() -> None:
    program = Program.parse(INPUT)
    kept, (result,) = Pipeline([LowerSpecializedCollectivesPass(lower_ciphertext_add=False)]).run(program)
    assert result.stats == PassStats(matched=2, skipped=2)
    assert [d.severity for d in result.diagnostics] == ["note", "note"]
    assert kept.to_text() == program.to_text()


def test_lowering_refuses_an_operation_pinned_to_an_implementation() -> None:
    pinned = INPUT.replace(
        '{note = "kept"}', '{fhelium.execution.implementation = "torch-ciphertext-add-all-reduce"}'
    )
    program = Program.parse(pinned)
    with pytest.raises(PassError, match=r"requests Backend implementation .*preserve the operation"):
        Pipeline([LowerSpecializedCollectivesPass()]).run(program)


def test_lowered_op_is_a_known_region_owner() -> None:
    lowered, _ = Pipeline([LowerSpecializedCollectivesPass()]).run(Program.parse(INPUT))
    adds = [op for op in program_operations(lowered) if op.name == "fhelium_ckks.add"]
    assert len(adds) == 2
