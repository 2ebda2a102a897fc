"""The training program of the fault tests: every rank all-reduces in a loop, printing each step.

Agent and relay roles exit inside `flodld.run` before torch is imported. A rank runs FAULT_STEPS steps
(default: until killed, at most 60 s), so a test can kill any process mid-collective.
"""

from __future__ import annotations

import os
import sys
import time

import flodld


def main() -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    steps = int(os.environ.get("FAULT_STEPS", "0"))
    rank, world = dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + 60
    step = 0
    while time.monotonic() < deadline and (steps == 0 or step < steps):
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        assert value.item() == world * (world + 1) / 2
        step += 1
        print(f"fault-rank {rank} step {step}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
