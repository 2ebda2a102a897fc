"""Process-group features, one row per run: `python torchrun_features.py ROW [DIR]` under torchrun or flodld.

A stock torchrun script (env://, gloo on CPU, no flodld import) unless FEATURES_VIA_FLODLD=1, which joins
through `flodld.run` (the controller store directly). Each row prints `ROW ok rank=R` on every rank when
its checks pass, and raises otherwise. Row `every` runs every row but pipelining in one process group.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn


def ddp(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10 + rank)  # every rank its own batch
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], other) for other in gathered), "DDP replicas diverged"
    assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in _model().parameters()]))


def object_collectives(rank: int, world: int) -> None:
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "name": f"r{rank}"})
    assert gathered == [{"rank": r, "name": f"r{r}"} for r in range(world)], gathered
    box: list[object] = [{"from": 0, "payload": list(range(5))} if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] == {"from": 0, "payload": [0, 1, 2, 3, 4]}
    out: list[object] = [None]
    dist.scatter_object_list(out, [f"piece{r}" for r in range(world)] if rank == 0 else None, src=0)
    assert out[0] == f"piece{rank}"
    into: list[object] | None = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), into, dst=0)
    if rank == 0:
        assert into == [("g", r) for r in range(world)]


def monitored_barrier(rank: int, world: int) -> None:
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)


def split_group(rank: int, world: int) -> None:
    try:
        group = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    except (RuntimeError, ValueError) as error:
        # torch splits NCCL (and plugin) groups only; a gloo group on CPU is refused the same under torchrun.
        print(f"split_group unsupported rank={rank}: {error}", flush=True)
        return
    assert group is not None
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    assert t.item() == (1.0 if rank < 2 else 5.0), t


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _weight_grad(layer: nn.Module) -> torch.Tensor:
    """The gradient of a Linear layer's weight, which the backward pass has set."""
    assert isinstance(layer, nn.Linear) and layer.weight.grad is not None
    return layer.weight.grad


def fsdp2_hsdp(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference, model = _model(), _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = torch.randn(world, 3, 8)
    model(batches[rank]).sum().backward()
    optim.step()
    # The reference sees the whole world's batch; HSDP averages gradients over all four ranks.
    (reference(batches.reshape(-1, 8)).sum() / world).backward()
    ref_optim.step()
    for (name, sharded), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = cast(DTensor, sharded).full_tensor()  # fully_shard made every parameter a DTensor
        assert torch.allclose(full, ref, atol=1e-5), name


def tensor_parallel(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    reference, model = _model(), _model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(2)
    x = torch.randn(5, 8)
    out = model(x)
    assert torch.allclose(out, reference(x), atol=1e-5), (out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    grad = cast(DTensor, _weight_grad(model[0])).full_tensor()  # ColwiseParallel sharded it
    assert torch.allclose(grad, _weight_grad(reference[0]), atol=1e-5)


def pipelining(rank: int, world: int) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    assert world == 2, "the pipelining row runs on two ranks"
    full = _model()
    stage_module = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(stage_module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = ScheduleGPipe(
        stage, n_microbatches=2, loss_fn=lambda out, target: ((out - target) ** 2).mean()
    )
    torch.manual_seed(3)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    if rank == 0:
        schedule.step(x)
    else:
        losses: list[torch.Tensor] = []
        out = schedule.step(target=target, losses=losses)
        expected = _model()(x)
        assert torch.allclose(out, expected, atol=1e-5), (out, expected)
        assert len(losses) == 2


def checkpoint(rank: int, world: int) -> None:
    # torch.distributed.checkpoint re-exports these without `as` (not exported to mypy); the same functions
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    directory = sys.argv[2]
    state = {"weights": torch.full((4,), float(rank)), "step": torch.tensor([7 + rank])}
    sharded = {"model": {"w": state["weights"]}, "extra": {"rank_step": state["step"]}}
    save({"model": {"w": torch.arange(6.0)}, f"rank{rank}": sharded["extra"]}, checkpoint_id=directory)
    loaded = {"model": {"w": torch.zeros(6)}, f"rank{rank}": {"rank_step": torch.zeros(1, dtype=torch.long)}}
    load(loaded, checkpoint_id=directory)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0))
    assert loaded[f"rank{rank}"]["rank_step"].item() == 7 + rank


def every(rank: int, world: int) -> None:
    """Every row that runs at any world size, one after another in one process group (pipelining needs
    exactly two ranks: run it on its own).
    """
    for name, row in ROWS.items():
        if name in ("every", "pipelining"):
            continue
        row(rank, world)
        dist.barrier()
        print(f"{name} ok rank={rank}", flush=True)


ROWS = {
    "ddp": ddp,
    "object_collectives": object_collectives,
    "monitored_barrier": monitored_barrier,
    "split_group": split_group,
    "fsdp2_hsdp": fsdp2_hsdp,
    "tensor_parallel": tensor_parallel,
    "pipelining": pipelining,
    "checkpoint": checkpoint,
    "every": every,
}


def main() -> int:
    row = sys.argv[1]
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ROWS[row](rank, world)
    dist.barrier()
    print(f"{row} ok rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if os.environ.get("FEATURES_VIA_FLODLD") == "1":
        import flodld

        sys.exit(flodld.run(main))
    sys.exit(main())
