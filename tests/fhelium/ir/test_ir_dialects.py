"""Dialect catalog, textual round trip, and structural verification of the fhelium dialects."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdsl.dialects.builtin import IndexType

from fhelium.ir import Program, ProgramError, create_dialect_context, registered_dialect_names
from fhelium.ir.dialects import ckks, core, distributed, memory

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

CT = '!fhelium_ckks.ciphertext<{basis = "Q", components = 2 : i64, depth = 0 : i64}>'

FULL_VOCABULARY = f"""builtin.module {{
  func.func @main(%x: {CT}, %t: tensor<4xi64>) -> ({CT}, tensor<4xi64>, index) {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %d = "fhelium.resource.ref"() {{symbol = "host", kind = "execution-device"}}
        : () -> !fhelium_memory.device
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %p = "fhelium_dist.group_size"(%g) : (!fhelium_dist.group) -> index
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %is_root = arith.cmpi eq, %r, %c0 : index
    %n = scf.if %is_root -> (index) {{
      scf.yield %p : index
    }} else {{
      scf.yield %c1 : index
    }}
    %acc = scf.for %i = %c0 to %n step %c1 iter_args(%a = %x) -> ({CT}) {{
      %s = "fhelium_ckks.add"(%a, %x) : ({CT}, {CT}) -> {CT}
      scf.yield %s : {CT}
    }}
    %b = "fhelium_dist.broadcast"(%t, %g) {{root = 0 : i64}}
        : (tensor<4xi64>, !fhelium_dist.group) -> tensor<4xi64>
    %m = "fhelium_memory.transfer"(%b, %d) {{memory_space = "pinned_host"}}
        : (tensor<4xi64>, !fhelium_memory.device) -> tensor<4xi64>
    %sum = "fhelium_dist.all_reduce_add_ciphertext"(%acc, %g) : ({CT}, !fhelium_dist.group) -> {CT}
    %red = "fhelium_dist.all_reduce"(%sum, %g) ({{
    ^bb0(%lhs: {CT}, %rhs: {CT}):
      %c = "fhelium_ckks.subtract"(%lhs, %rhs) : ({CT}, {CT}) -> {CT}
      "fhelium_dist.yield"(%c) : ({CT}) -> ()
    }}) : ({CT}, !fhelium_dist.group) -> {CT}
    func.return %red, %m, %r : {CT}, tensor<4xi64>, index
  }}
}}
"""


def test_catalog_registers_fhelium_dialects_in_order() -> None:
    assert registered_dialect_names() == ("fhelium", "fhelium_ckks", "fhelium_dist", "fhelium_memory")
    context = create_dialect_context()
    for name in (
        "fhelium_dist.rank",
        "fhelium_dist.group_size",
        "fhelium_dist.broadcast",
        "fhelium_dist.all_reduce",
        "fhelium_dist.all_reduce_add_ciphertext",
        "fhelium_dist.yield",
        "fhelium_memory.transfer",
        "fhelium_ckks.add",
        "fhelium.resource.ref",
        "arith.addi",
        "scf.for",
        "scf.if",
        "func.func",
    ):
        assert context.get_optional_op(name) is not None, name
    assert context.get_optional_type("fhelium_dist.group") is distributed.GroupType
    assert context.get_optional_type("fhelium_memory.device") is memory.DeviceType
    assert context.get_optional_type("fhelium_ckks.ciphertext") is ckks.CiphertextType


def test_full_vocabulary_round_trips_identically() -> None:
    program = Program.parse(FULL_VOCABULARY)
    text = program.to_text()
    assert Program.parse(text).to_text() == text
    generic = program.to_text(generic=True)
    assert Program.parse(generic).to_text(generic=True) == generic
    names = [op.name for op in program.walk()]
    assert names.count("fhelium_dist.yield") == 1
    assert "fhelium_memory.transfer" in names


def test_parsed_ops_are_the_registered_classes() -> None:
    program = Program.parse(FULL_VOCABULARY)
    by_name = {op.name: op for op in program.walk()}
    assert isinstance(by_name["fhelium_dist.rank"], distributed.RankOp)
    assert isinstance(by_name["fhelium_dist.rank"].results[0].type, IndexType)
    transfer = by_name["fhelium_memory.transfer"]
    assert isinstance(transfer, memory.TransferOp) and transfer.memory_space_name == "pinned_host"
    broadcast = by_name["fhelium_dist.broadcast"]
    assert isinstance(broadcast, distributed.BroadcastOp) and broadcast.root.value.data == 0
    ref = by_name["fhelium.resource.ref"]
    assert isinstance(ref, core.ResourceRefOp)


def test_bare_and_stated_types_are_distinct_and_round_trip() -> None:
    text = """builtin.module {
  %0 = "vendor.make"() : () -> !fhelium_ckks.ciphertext
  %1 = "vendor.make"() : () -> !fhelium_ckks.ciphertext<{depth = 1 : i64, prime_ids = [1 : i64, 2 : i64]}>
}
"""
    program = Program.parse(text)
    assert program.to_text() == text
    bare, stated = (op.results[0].type for op in program.module.ops)
    assert isinstance(bare, ckks.CiphertextType) and isinstance(stated, ckks.CiphertextType)
    assert bare != stated
    assert stated.state_int("depth") == 1 and stated.state_ints("prime_ids") == (1, 2)


def test_example_program_round_trips() -> None:
    program = Program.load(EXAMPLES / "ir_allreduce.mlir")
    text = program.to_text()
    assert Program.parse(text).to_text() == text


def test_unknown_vendor_ops_survive_round_trip() -> None:
    text = """builtin.module {
  %0 = "vendor.ckks.bootstrap"() ({
    "vendor.inner"() : () -> ()
  }) : () -> !third_party.tensor<4>
}
"""
    assert Program.parse(text).to_text() == text


def _verify_error(body: str) -> str:
    with pytest.raises(ProgramError) as raised:
        Program.parse(f"builtin.module {{\n{body}\n}}\n")
    return str(raised.value)


def test_broadcast_result_type_must_match_operand() -> None:
    message = _verify_error(
        '%g = "fhelium.resource.ref"() {symbol = "w", kind = "process-group"} : () -> !fhelium_dist.group\n'
        '%t = "vendor.t"() : () -> tensor<4xi64>\n'
        '%b = "fhelium_dist.broadcast"(%t, %g) {root = 0 : i64} : (tensor<4xi64>, !fhelium_dist.group) -> '
        "tensor<4xi32>"
    )
    assert "fhelium_dist.broadcast: result 'result'" in message
    assert "expected from variable 'T', but got tensor<4xi32>" in message


def test_broadcast_requires_root() -> None:
    message = _verify_error(
        '%g = "fhelium.resource.ref"() {symbol = "w", kind = "process-group"} : () -> !fhelium_dist.group\n'
        '%t = "vendor.t"() : () -> tensor<4xi64>\n'
        '%b = "fhelium_dist.broadcast"(%t, %g) : (tensor<4xi64>, !fhelium_dist.group) -> tensor<4xi64>'
    )
    assert "root" in message


def test_rank_needs_a_group_operand() -> None:
    message = _verify_error(
        '%t = "vendor.t"() : () -> index\n%r = "fhelium_dist.rank"(%t) : (index) -> index'
    )
    assert "fhelium_dist.group" in message


def _all_reduce(block: str, value_type: str = "tensor<4xi64>") -> str:
    return (
        '%g = "fhelium.resource.ref"() {symbol = "w", kind = "process-group"} : () -> !fhelium_dist.group\n'
        f'%t = "vendor.t"() : () -> {value_type}\n'
        f'%r = "fhelium_dist.all_reduce"(%t, %g) ({{\n{block}\n}}) : ({value_type}, !fhelium_dist.group) -> '
        f"{value_type}"
    )


def test_all_reduce_combine_needs_two_arguments_of_the_value_type() -> None:
    message = _verify_error(
        _all_reduce('^bb0(%a: tensor<4xi64>):\n  "fhelium_dist.yield"(%a) : (tensor<4xi64>) -> ()')
    )
    assert "combine arguments must match the reduced value type" in message
    message = _verify_error(
        _all_reduce(
            '^bb0(%a: tensor<4xi64>, %b: tensor<4xi32>):\n  "fhelium_dist.yield"(%a) : (tensor<4xi64>) -> ()'
        )
    )
    assert "combine arguments must match the reduced value type" in message


def test_all_reduce_combine_must_end_with_dist_yield() -> None:
    message = _verify_error(
        _all_reduce('^bb0(%a: tensor<4xi64>, %b: tensor<4xi64>):\n  "vendor.end"(%a) : (tensor<4xi64>) -> ()')
    )
    assert "must end with fhelium_dist.yield" in message


def test_all_reduce_yield_type_must_match() -> None:
    message = _verify_error(
        _all_reduce(
            "^bb0(%a: tensor<4xi64>, %b: tensor<4xi64>):\n"
            '  %c = "vendor.cast"(%a) : (tensor<4xi64>) -> tensor<4xi32>\n'
            '  "fhelium_dist.yield"(%c) : (tensor<4xi32>) -> ()'
        )
    )
    assert "must yield tensor<4xi64>" in message


def test_specialized_all_reduce_requires_ciphertexts() -> None:
    message = _verify_error(
        '%g = "fhelium.resource.ref"() {symbol = "w", kind = "process-group"} : () -> !fhelium_dist.group\n'
        '%t = "vendor.t"() : () -> tensor<4xi64>\n'
        '%r = "fhelium_dist.all_reduce_add_ciphertext"(%t, %g) : (tensor<4xi64>, !fhelium_dist.group) -> '
        "tensor<4xi64>"
    )
    assert "fhelium_ckks.ciphertext" in message


def test_transfer_rejects_unknown_memory_space() -> None:
    message = _verify_error(
        '%d = "fhelium.resource.ref"() {symbol = "d", kind = "execution-device"} : () -> '
        "!fhelium_memory.device\n"
        '%t = "vendor.t"() : () -> tensor<4xi64>\n'
        '%m = "fhelium_memory.transfer"(%t, %d) {memory_space = "vram"} : (tensor<4xi64>, '
        "!fhelium_memory.device) -> tensor<4xi64>"
    )
    assert "memory_space must be 'default', 'pageable_host', or 'pinned_host'" in message


def test_ckks_add_requires_matching_states() -> None:
    other = "!fhelium_ckks.ciphertext<{depth = 1 : i64}>"
    message = _verify_error(
        f'%a = "vendor.a"() : () -> {CT}\n%b = "vendor.b"() : () -> {other}\n'
        f'%c = "fhelium_ckks.add"(%a, %b) : ({CT}, {other}) -> {CT}'
    )
    assert "fhelium_ckks.add: operand 'rhs'" in message
    assert f"expected from variable 'T', but got {other}" in message


_GROUP = '%g = "fhelium.resource.ref"() {symbol = "w", kind = "process-group"} : () -> !fhelium_dist.group\n'
_DEVICE = (
    '%d = "fhelium.resource.ref"() {symbol = "d", kind = "execution-device"} : () -> !fhelium_memory.device\n'
)
_DEPTH1 = "!fhelium_ckks.ciphertext<{depth = 1 : i64}>"
_COMBINE = f' ({{\n^bb0(%l: {CT}, %r: {CT}):\n  "fhelium_dist.yield"(%l) : ({CT}) -> ()\n}})'
_WITH_GROUP = f"({CT}, !fhelium_dist.group)"


@pytest.mark.parametrize(
    ("name", "prelude", "operands", "types"),
    [
        ("fhelium_ckks.add", "", "(%a, %a)", f"({CT}, {CT})"),
        ("fhelium_ckks.subtract", "", "(%a, %a)", f"({CT}, {CT})"),
        ("fhelium_ckks.negate", "", "(%a)", f"({CT})"),
        ("fhelium_dist.broadcast", _GROUP, "(%a, %g) {root = 0 : i64}", _WITH_GROUP),
        ("fhelium_dist.all_reduce", _GROUP, "(%a, %g)" + _COMBINE, _WITH_GROUP),
        ("fhelium_dist.all_reduce_add_ciphertext", _GROUP, "(%a, %g)", _WITH_GROUP),
        ("fhelium_memory.transfer", _DEVICE, "(%a, %d)", f"({CT}, !fhelium_memory.device)"),
    ],
)
def test_value_preserving_ops_require_one_type_for_operands_and_result(
    name: str, prelude: str, operands: str, types: str
) -> None:
    """Every op whose result is "the same kind of value" shares one xDSL type variable T."""
    body = f'%a = "vendor.a"() : () -> {CT}\n{prelude}%c = "{name}"{operands} : {types} -> {_DEPTH1}'
    message = _verify_error(body)
    assert f"{name}: result 'result'" in message
    assert f"expected from variable 'T', but got {_DEPTH1}" in message


def test_parse_error_names_the_source() -> None:
    with pytest.raises(ProgramError, match=r"prog\.mlir"):
        Program.parse("builtin.module { %0 = ", source_name="prog.mlir")


def test_function_lookup_errors_name_known_functions() -> None:
    program = Program.parse(FULL_VOCABULARY)
    assert program.function().sym_name.data == "main"
    with pytest.raises(ProgramError, match="no function @other; functions: main"):
        program.function("other")
