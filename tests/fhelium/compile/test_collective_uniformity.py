"""The opt-in analysis that reports collectives some ranks may skip."""

from __future__ import annotations

from pathlib import Path

from fhelium.compile import Pipeline
from fhelium.compile.passes import CheckCollectiveUniformityPass
from fhelium.ir import Program

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
T = "tensor<4xi64>"
HEADER = f"""builtin.module {{
  func.func @main(%x: {T}, %n: index) -> {T} {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %p = "fhelium_dist.group_size"(%g) : (!fhelium_dist.group) -> index
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
"""
FOOTER = f"""    func.return %out : {T}
  }}
}}
"""
BCAST = f'"fhelium_dist.broadcast"(%x, %g) {{root = 0 : i64}} : ({T}, !fhelium_dist.group) -> {T}'


def _diagnose(body: str) -> list[str]:
    program = Program.parse(HEADER + body + FOOTER)
    _, (result,) = Pipeline([CheckCollectiveUniformityPass()]).run(program)
    return [f"{d.severity}: {d.message}" for d in result.diagnostics]


def _broadcast_if(condition: str) -> str:
    """`%out`: %x broadcast where CONDITION holds, %x itself where it does not."""
    return f"""    %out = scf.if {condition} -> ({T}) {{
      %b = {BCAST}
      scf.yield %b : {T}
    }} else {{
      scf.yield %x : {T}
    }}
"""


def _broadcast_for(lower: str, upper: str) -> str:
    """`%out`: %x broadcast once per trip of a loop from LOWER to UPPER."""
    return f"""    %out = scf.for %i = {lower} to {upper} step %c1 iter_args(%a = %x) -> ({T}) {{
      %b = "fhelium_dist.broadcast"(%a, %g) {{root = 0 : i64}} : ({T}, !fhelium_dist.group) -> {T}
      scf.yield %b : {T}
    }}
"""


def test_collective_under_rank_dependent_if_is_reported() -> None:
    found = _diagnose("    %is_root = arith.cmpi eq, %r, %c0 : index\n" + _broadcast_if("%is_root"))
    assert len(found) == 1
    assert found[0].startswith("error: fhelium_dist.broadcast may be reached by some ranks and not others")
    assert "scf.if condition depends on rank" in found[0]


def test_collective_under_uniform_if_is_accepted() -> None:
    found = _diagnose("    %big = arith.cmpi sgt, %p, %c1 : index\n" + _broadcast_if("%big"))
    assert found == []


def test_collective_in_loop_with_rank_dependent_trip_count_is_reported() -> None:
    found = _diagnose(_broadcast_for("%c0", "%r"))
    assert len(found) == 1 and "scf.for trip count depends on rank" in found[0]


def test_rank_selected_interval_of_uniform_length_is_accepted() -> None:
    found = _diagnose(
        "    %lo = arith.muli %r, %n : index\n"
        "    %hi = arith.addi %lo, %n : index\n" + _broadcast_for("%lo", "%hi")
    )
    assert found == []


def test_rank_dependence_through_loop_carried_values_is_tracked() -> None:
    found = _diagnose(
        """    %k = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %c0) -> (index) {
      %next = arith.addi %acc, %r : index
      scf.yield %next : index
    }
    %zero = arith.cmpi eq, %k, %c0 : index
"""
        + _broadcast_if("%zero")
    )
    assert len(found) == 1 and "scf.if condition depends on rank" in found[0]


def test_collective_results_are_uniform_again() -> None:
    found = _diagnose(
        f"""    %mine = "vendor.from_index"(%r) : (index) -> {T}
    %shared = "fhelium_dist.broadcast"(%mine, %g) {{root = 0 : i64}} : ({T}, !fhelium_dist.group) -> {T}
    %k = "vendor.to_index"(%shared) : ({T}) -> index
    %go = arith.cmpi eq, %k, %c0 : index
"""
        + _broadcast_if("%go")
    )
    assert found == []
    diverging = _diagnose(
        f"""    %mine = "vendor.from_index"(%r) : (index) -> {T}
    %k = "vendor.to_index"(%mine) : ({T}) -> index
    %go = arith.cmpi eq, %k, %c0 : index
"""
        + _broadcast_if("%go")
    )
    assert len(diverging) == 1


def test_collectives_inside_opaque_owner_get_a_warning() -> None:
    found = _diagnose(
        f"""    %out = "vendor.region"(%x) ({{
    ^bb0(%v: {T}):
      %b = "fhelium_dist.broadcast"(%v, %g) {{root = 0 : i64}} : ({T}, !fhelium_dist.group) -> {T}
      "vendor.yield"(%b) : ({T}) -> ()
    }}) : ({T}) -> {T}
"""
    )
    assert found == [
        "warning: vendor.region owns regions this analysis cannot enter and contains collectives "
        "(fhelium_dist.broadcast); their uniformity is not checked"
    ]


def test_example_program_is_uniform() -> None:
    program = Program.load(EXAMPLES / "ir_allreduce.mlir")
    _, (result,) = Pipeline([CheckCollectiveUniformityPass()]).run(program)
    assert result.diagnostics == ()
    assert result.stats.matched == 1
