"""Test program for `fdl run` on GPUs: every rank all-reduces a CUDA tensor and reports how.

Each rank prints `rank R/W: nccl all_reduce ok on cuda:0 (physical GPU G, backend B)`, or an error
line and exit 1 when the sum is wrong, the backend is not nccl or the rank does not own one GPU.
"""

from __future__ import annotations

import os
import sys

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402
from flodld.rank import rank_device  # noqa: E402


def main() -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    backend = str(dist.get_backend())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if device.type != "cuda" or backend != "nccl" or torch.cuda.device_count() != 1:
        print(f"rank {rank}/{world}: expected one GPU over nccl, got device {device}, backend {backend}, "
              f"{torch.cuda.device_count()} visible GPU(s) (CUDA_VISIBLE_DEVICES={visible!r})", flush=True)
        return 1
    total = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    if not torch.all(total == expected).item():
        print(f"rank {rank}/{world}: all_reduce gave {total[0].item()}, expected {expected}", flush=True)
        return 1
    print(f"rank {rank}/{world}: nccl all_reduce ok on {device} (physical GPU {visible}, backend {backend})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
