"""Test program for walk-in worlds: gloo all_reduce, then CPU averages through the relays.

Round 0: every rank deposits [rank, 10*rank]; the result must be the mean over all ranks.
Then the highest rank leaves (folded out) and round 1 must be the mean over the others.
Also checks that no process's command line carries this run's salt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402
import flodld.rank  # noqa: E402
from flodld.rank.averaging import all_average  # noqa: E402


def salt_in_any_cmdline(salt_hex: str) -> list[int]:
    leaks = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if salt_hex.encode() in (entry / "cmdline").read_bytes():
                    leaks.append(int(entry.name))
            except OSError:
                continue
    return leaks


def main() -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} controller={os.environ['FLODL_CONTROLLER']}", flush=True)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    assert "FLODL_INTERNAL_SALT" not in os.environ, "the salt stayed in the rank's environment"
    leaks = salt_in_any_cmdline(flodld.rank.read_rank_environment().salt.hex())
    if leaks:
        print(f"rank {rank}: salt visible in the command line of pids {leaks}", flush=True)
        return 1
    (mean,) = all_average([torch.tensor([float(rank), 10.0 * rank])])
    expected = torch.tensor([(world - 1) / 2, 10 * (world - 1) / 2])
    assert torch.allclose(mean, expected), (mean, expected)
    print(f"rank {rank}: round 0 mean ok {mean.tolist()}", flush=True)
    if rank == world - 1:
        return 0  # leaves; the others' next round is folded without it
    (mean,) = all_average([torch.tensor([float(rank), 10.0 * rank])])
    expected = torch.tensor([(world - 2) / 2, 10 * (world - 2) / 2])
    assert torch.allclose(mean, expected), (mean, expected)
    print(f"rank {rank}: round 1 mean without rank {world - 1} ok {mean.tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
