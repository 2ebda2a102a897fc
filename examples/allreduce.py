"""A real distributed job: every rank all-reduces a tensor through the controller rendezvous.

Run it with `fdl run examples/allreduce.py` (one rank per GPU over nccl, or 2 CPU ranks over gloo on a
host without GPU) or `fdl run --ranks 3 examples/allreduce.py`.
Each rank contributes (rank + 1) * [1, 2, 3, 4]; the sum must be world_size * (world_size + 1) / 2 times
that vector, and every rank checks it. With `--average` it also averages through the CPU relays.
"""

from __future__ import annotations

import argparse
import sys

from flodld.launcher import exit_if_worker_role

# Agent and relay roles run and exit here, before the (slow) torch import they do not need.
exit_if_worker_role()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402
from flodld.rank import rank_device  # noqa: E402
from flodld.rank.averaging import all_average  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--average", action="store_true", help="also average a tensor through the relays")
    args = parser.parse_args()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.tensor([1.0, 2.0, 3.0, 4.0], device=rank_device())  # cuda:0 under nccl, else cpu
    total = base * (rank + 1)
    dist.all_reduce(total)
    expected = base * (world * (world + 1) / 2)
    if not torch.equal(total, expected):
        print(f"rank {rank}: all_reduce gave {total.tolist()}, expected {expected.tolist()}", flush=True)
        return 1
    print(f"rank {rank}/{world}: all_reduce ok {total.tolist()} on {total.device}", flush=True)
    if args.average:
        (mean,) = all_average([torch.full((3,), float(rank))])
        print(f"rank {rank}/{world}: relay average {mean.tolist()}", flush=True)
        if not torch.allclose(mean, torch.full((3,), (world - 1) / 2)):
            return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
