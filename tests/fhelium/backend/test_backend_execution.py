"""Single-process Backend execution: scalar arith, scf, CKKS RNS ops, boundary and link errors."""

from __future__ import annotations

import pytest
import torch

from fhelium.backend import (
    BoundResource,
    ExecutionError,
    ImplementationError,
    OperationBackend,
    OperationImplementationRegistry,
    ResourceError,
    default_registry,
)
from fhelium.backend._boundary import BoundaryError
from fhelium.backend.rns import RnsModuli, TorchRnsAddImplementation
from fhelium.core import Ciphertext
from fhelium.ir import Program

MODULI = (97, 101, 103, 107)
RNS = BoundResource("rns", "rns-moduli", RnsModuli(MODULI))
CT = "!fhelium_ckks.ciphertext<{depth = 1 : i64, components = 2 : i64}>"


def _backend(*resources: BoundResource) -> OperationBackend:
    return OperationBackend(default_registry(), [RNS, *resources])


def _run(text: str, *inputs: object) -> tuple[object, ...]:
    return _backend().link(Program.parse(text)).run(*inputs)


def _ciphertext(seed: int, depth: int = 1, limbs: int = 3) -> Ciphertext:
    generator = torch.Generator().manual_seed(seed)
    prime_ids = tuple(range(depth, depth + limbs))
    rows = [torch.randint(0, MODULI[i], (2, 1, 8), generator=generator) for i in prime_ids]
    return Ciphertext(torch.cat(rows, dim=1), depth, 2.0**30, prime_ids)


def _moduli_column(prime_ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([MODULI[i] for i in prime_ids]).view(1, -1, 1)


def test_scf_for_with_iter_args_sums_an_index_range() -> None:
    text = """builtin.module {
  func.func @main(%lo: index, %hi: index) -> index {
    %c0 = arith.constant 0 : index
    %c2 = arith.constant 2 : index
    %sum = scf.for %i = %lo to %hi step %c2 iter_args(%acc = %c0) -> (index) {
      %next = arith.addi %acc, %i : index
      scf.yield %next : index
    }
    func.return %sum : index
  }
}
"""
    assert _run(text, 3, 12) == (3 + 5 + 7 + 9 + 11,)
    assert _run(text, 5, 5) == (0,)


ARITH = """builtin.module {
  func.func @main(%a: index, %b: index) -> (index, index, index, index, index, index, index, index, i1, i64) {
    %sub = arith.subi %a, %b : index
    %mul = arith.muli %a, %b : index
    %div = arith.divsi %sub, %b : index
    %floor = arith.floordivsi %sub, %b : index
    %rem = arith.remsi %sub, %b : index
    %min = arith.minsi %a, %b : index
    %max = arith.maxui %a, %b : index
    %lt = arith.cmpi slt, %a, %b : index
    %sel = arith.select %lt, %a, %b : index
    %cast = arith.index_cast %mul : index to i64
    func.return %sub, %mul, %div, %floor, %rem, %min, %max, %sel, %lt, %cast
        : index, index, index, index, index, index, index, index, i1, i64
  }
}
"""


def test_scalar_arith_follows_mlir_semantics() -> None:
    # sub = -4: divsi truncates toward zero, floordivsi rounds down, remsi keeps the dividend's sign.
    assert _run(ARITH, 3, 7) == (-4, 21, 0, -1, -4, 3, 7, 3, True, 21)
    assert _run(ARITH, 9, 2) == (7, 18, 3, 3, 1, 2, 9, 2, False, 18)


def test_scf_if_selects_the_branch_and_runs_ckks_ops_inside() -> None:
    text = f"""builtin.module {{
  func.func @main(%x: {CT}, %y: {CT}, %k: index) -> {CT} {{
    %c0 = arith.constant 0 : index
    %pos = arith.cmpi sgt, %k, %c0 : index
    %r = scf.if %pos -> ({CT}) {{
      %s = "fhelium_ckks.add"(%x, %y) : ({CT}, {CT}) -> {CT}
      scf.yield %s : {CT}
    }} else {{
      %d = "fhelium_ckks.subtract"(%x, %y) : ({CT}, {CT}) -> {CT}
      %n = "fhelium_ckks.negate"(%d) : ({CT}) -> {CT}
      scf.yield %n : {CT}
    }}
    func.return %r : {CT}
  }}
}}
"""
    x, y = _ciphertext(1), _ciphertext(2)
    q = _moduli_column(x.prime_ids)
    (added,) = _run(text, x, y, 1)
    (negated,) = _run(text, x, y, -1)
    assert isinstance(added, Ciphertext) and isinstance(negated, Ciphertext)
    assert torch.equal(added.data, (x.data + y.data) % q)
    assert torch.equal(negated.data, (y.data - x.data) % q)
    assert added.scale == x.scale and added.prime_ids == x.prime_ids and added.depth == 1
    assert added.data.data_ptr() != x.data.data_ptr()


def test_declared_prime_ids_select_the_moduli() -> None:
    ct_type = "!fhelium_ckks.ciphertext<{prime_ids = [0 : i64, 3 : i64]}>"
    text = f"""builtin.module {{
  func.func @main(%x: {ct_type}) -> {ct_type} {{
    %s = "fhelium_ckks.add"(%x, %x) : ({ct_type}, {ct_type}) -> {ct_type}
    func.return %s : {ct_type}
  }}
}}
"""
    data = torch.stack([torch.full((2, 4), 90), torch.full((2, 4), 100)], dim=1)
    x = Ciphertext(data, 0, 1.0, (0, 3))
    (out,) = _run(text, x)
    assert isinstance(out, Ciphertext)
    assert torch.unique(out.data[:, 0]).tolist() == [(180) % 97] and torch.unique(
        out.data[:, 1]
    ).tolist() == [200 % 107]


def test_boundary_rejects_a_ciphertext_in_the_wrong_state() -> None:
    text = f"""builtin.module {{
  func.func @main(%x: {CT}) -> {CT} {{
    func.return %x : {CT}
  }}
}}
"""
    with pytest.raises(BoundaryError, match="argument 0: declared depth = 1 but the value has 0"):
        _run(text, _ciphertext(3, depth=0))
    with pytest.raises(BoundaryError, match="expected a Ciphertext"):
        _run(text, torch.zeros(2, 3, 8, dtype=torch.int64))


def test_link_fails_for_a_missing_resource() -> None:
    text = """builtin.module {
  func.func @main() -> index {
    %g = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    func.return %r : index
  }
}
"""
    with pytest.raises(
        ResourceError, match="Required resource 'world' \\(kind 'process-group'\\) is not bound"
    ):
        _backend().link(Program.parse(text))
    wrong_kind = BoundResource("world", "execution-device", torch.device("cpu"))
    with pytest.raises(
        ResourceError, match="Resource 'world' has kind 'execution-device'; required 'process-group'"
    ):
        _backend(wrong_kind).link(Program.parse(text))


def test_link_fails_for_an_operation_without_implementation() -> None:
    text = """builtin.module {
  func.func @main(%x: tensor<4xi64>) -> tensor<4xi64> {
    %y = "vendor.op"(%x) : (tensor<4xi64>) -> tensor<4xi64>
    func.return %y : tensor<4xi64>
  }
}
"""
    with pytest.raises(ExecutionError, match=r"no Backend implementation is registered for vendor\.op"):
        _backend().link(Program.parse(text))


def test_recorded_implementation_is_a_hard_constraint() -> None:
    text = f"""builtin.module {{
  func.func @main(%x: {CT}) -> {CT} {{
    %s = "fhelium_ckks.add"(%x, %x) {{fhelium.execution.implementation = "gpu-add"}} : ({CT}, {CT}) -> {CT}
    func.return %s : {CT}
  }}
}}
"""
    with pytest.raises(
        ExecutionError,
        match=r"requests implementation 'gpu-add'.*registered for this operation: torch-rns-add",
    ):
        _backend().link(Program.parse(text))


def test_registry_refuses_ambiguous_defaults() -> None:
    class OtherAdd(TorchRnsAddImplementation):
        name = "other-add"

    registry = OperationImplementationRegistry([TorchRnsAddImplementation(), OtherAdd()])
    text = f"""builtin.module {{
  func.func @main(%x: {CT}) -> {CT} {{
    %s = "fhelium_ckks.add"(%x, %x) : ({CT}, {CT}) -> {CT}
    func.return %s : {CT}
  }}
}}
"""
    with pytest.raises(ExecutionError, match="several implementations \\(torch-rns-add, other-add\\)"):
        OperationBackend(registry, [RNS]).link(Program.parse(text))
    with pytest.raises(ImplementationError, match="already registered"):
        registry.register(OtherAdd())


def test_compiled_callable_shares_the_linked_executable() -> None:
    text = """builtin.module {
  func.func @main(%n: index) -> index {
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %s = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %c1) -> (index) {
      %d = arith.addi %acc, %acc : index
      scf.yield %d : index
    }
    func.return %s : index
  }
}
"""
    executable = _backend().link(Program.parse(text))
    compiled = executable.as_callable()
    assert compiled.__name__ == "main"
    assert compiled(10) == executable.run(10) == (1024,)
    with pytest.raises(ExecutionError, match="takes 1 arguments, got 2"):
        compiled(1, 2)
