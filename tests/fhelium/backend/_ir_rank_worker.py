"""One rank of the multi-rank Backend tests: runs every scenario on a real gloo group.

Usage: python _ir_rank_worker.py RANK WORLD_SIZE INIT_FILE OUTPUT_JSON
Writes a JSON object of scenario results; the test process compares ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported for real inside the functions that use them
    from fhelium.backend import OperationInvocation, ResourceRequirement
    from fhelium.backend.implementation import Resources, Tensors
    from fhelium.core import Ciphertext
    from fhelium.ir import Program

ROOT = Path(__file__).resolve().parents[3]

MODULI = (1_000_003, 998_244_353, 754_974_721)
# 3 x the first prime wraps int64 but 2 x does not: the sum schedule is exact for 2 ranks, not for 3
BIG_MODULI = (3_100_000_000_000_000_000, 1_000_003, 998_244_353)
CT = "!fhelium_ckks.ciphertext<{depth = 0 : i64}>"


def _fake_ciphertext(seed: int, moduli: tuple[int, ...] = MODULI) -> Ciphertext:
    from fhelium.core import Ciphertext

    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, q, (2, 1, 16), generator=generator) for q in moduli]
    return Ciphertext(torch.cat(rows, dim=1), 0, 2.0**40, tuple(range(len(moduli))))


class _UndeclaredAdd:
    """A registered add with the same arithmetic as the default one but without the
    ``canonical_modular_add`` declaration: the all-reduce must not assume it and takes the tree.
    """

    name = "test-undeclared-add"

    def __init__(self) -> None:
        from fhelium.ir.dialects import ckks

        self.operation_types = (ckks.AddOp,)

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]:
        from fhelium.backend import ResourceRequirement

        return (ResourceRequirement("rns", "rns-moduli"),)

    def execute(self, invocation: OperationInvocation, inputs: Tensors, resources: Resources) -> Tensors:
        from fhelium.backend.rns.operations import moduli_column, rns_add

        return (rns_add(inputs[0], inputs[1], moduli_column(invocation, inputs[0], resources[-1].value)),)


def _schedules(rank: int, world: int, example: Program) -> dict[str, Any]:
    """The compiled example's all-reduce, per adder and moduli: the schedule each rank ran and
    the result.
    """
    from fhelium.backend import BoundResource, OperationBackend, OperationImplementationRegistry
    from fhelium.backend.distributed import (
        TorchCiphertextAddAllReduceImplementation,
        bind_process_group,
        distributed_operation_contributions,
    )
    from fhelium.backend.rns import RnsModuli
    from fhelium.backend.rns.operations import ckks_operation_contributions

    out: dict[str, Any] = {}
    cases: dict[str, tuple[Any, tuple[int, ...]]] = {
        "declared_small": (None, MODULI),
        "declared_big": (None, BIG_MODULI),
        "undeclared_small": (_UndeclaredAdd(), MODULI),
    }
    for name, (add, moduli) in cases.items():
        ckks_ops = ckks_operation_contributions()
        all_reduce = TorchCiphertextAddAllReduceImplementation(add if add is not None else ckks_ops[0])
        registry = OperationImplementationRegistry(ckks_ops).extend(
            distributed_operation_contributions(ciphertext_add=all_reduce)
        )
        backend = OperationBackend(
            registry, [bind_process_group(), BoundResource("rns", "rns-moduli", RnsModuli(moduli))]
        )
        (result,) = backend.link(example).run(_fake_ciphertext(7 + rank, moduli), 1)
        assert all_reduce.last_trace is not None
        out[name] = {"algorithm": all_reduce.last_trace.algorithm, "data": result.data.tolist()}
    return out


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, output = sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)

    import fhelium.distributed as fdist
    from fhelium.backend import BoundResource, OperationBackend, default_registry
    from fhelium.backend.distributed import bind_process_group
    from fhelium.backend.rns import RnsModuli
    from fhelium.compile import Pipeline
    from fhelium.compile.passes import LowerSpecializedCollectivesPass
    from fhelium.ir import Program

    fdist.init(backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        rns = BoundResource("rns", "rns-moduli", RnsModuli(MODULI))
        backend = OperationBackend(default_registry(), [bind_process_group(), rns])

        query = Program.parse(
            """builtin.module {
  func.func @main() -> (index, index) {
    %g = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %p = "fhelium_dist.group_size"(%g) : (!fhelium_dist.group) -> index
    func.return %r, %p : index, index
  }
}
"""
        )
        results["query"] = list(backend.link(query).run())

        broadcast = Program.parse(
            """builtin.module {
  func.func @main(%x: tensor<5xi64>, %root: index) -> tensor<5xi64> {
    %g = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %b = "fhelium_dist.broadcast"(%x, %g) {root = %ROOT% : i64}
        : (tensor<5xi64>, !fhelium_dist.group) -> tensor<5xi64>
    func.return %b : tensor<5xi64>
  }
}
""".replace("%ROOT%", str(world - 1))
        )
        local = torch.full((5,), 10 * (rank + 1), dtype=torch.int64)
        (received,) = backend.link(broadcast).run(local, 0)
        results["broadcast"] = received.tolist()
        results["broadcast_input_untouched"] = local.tolist() == [10 * (rank + 1)] * 5

        # A visible, non-commutative combine region: the fold order is observable.
        combine = Program.parse(
            f"""builtin.module {{
  func.func @main(%x: {CT}) -> {CT} {{
    %g = "fhelium.resource.ref"() {{symbol = "world", kind = "process-group"}} : () -> !fhelium_dist.group
    %r = "fhelium_dist.all_reduce"(%x, %g) ({{
    ^bb0(%lhs: {CT}, %rhs: {CT}):
      %d = "fhelium_ckks.subtract"(%lhs, %rhs) : ({CT}, {CT}) -> {CT}
      "fhelium_dist.yield"(%d) : ({CT}) -> ()
    }}) : ({CT}, !fhelium_dist.group) -> {CT}
    func.return %r : {CT}
  }}
}}
"""
        )
        (folded,) = backend.link(combine).run(_fake_ciphertext(100 + rank))
        results["combine"] = folded.data.tolist()

        # The example: rank-selected loop interval, local adds, then a ciphertext all-reduce, run in
        # both the specialized form and the lowered generic form.
        example = Program.load(ROOT / "examples" / "ir_allreduce.mlir")
        lowered, _ = Pipeline([LowerSpecializedCollectivesPass()]).run(example)
        x = _fake_ciphertext(7)
        (specialized_out,) = backend.link(example).run(x, 2)
        (generic_out,) = backend.link(lowered).run(x, 2)
        results["example_specialized"] = specialized_out.data.tolist()
        results["example_generic"] = generic_out.data.tolist()
        results["example_metadata"] = [specialized_out.scale, list(specialized_out.prime_ids)]
        results["schedules"] = _schedules(rank, world, example)

        # Mismatched payload layouts (rank 0 holds one more limb): every rank fails in the control
        # exchange with the same error, before any payload moves, and the group stays usable.
        mismatched = _fake_ciphertext(100 + rank, MODULI if rank == 0 else MODULI[:2])
        try:
            backend.link(combine).run(mismatched)
            results["mismatch"] = None
        except Exception as error:  # recorded for the test process to compare across ranks
            results["mismatch"] = [type(error).__name__, str(error)]
        results["after_mismatch_query"] = list(backend.link(query).run())

        if world == 3:
            # A subgroup: IR ranks are group-relative; root 1 is global rank 2.
            subgroup = torch.distributed.new_group([1, 2])
            if rank in (1, 2):
                sub_backend = OperationBackend(default_registry(), [bind_process_group(subgroup), rns])
                results["subgroup_query"] = list(sub_backend.link(query).run())
                sub_broadcast = Program.parse(broadcast.to_text().replace("root = 2 : i64", "root = 1 : i64"))
                (sub_received,) = sub_backend.link(sub_broadcast).run(local, 0)
                results["subgroup_broadcast"] = sub_received.tolist()
    finally:
        fdist.shutdown()
    output.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
