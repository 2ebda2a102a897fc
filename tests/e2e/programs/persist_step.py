"""Test program for the persist walk-ins of a `flodld serve` service: one barrier, then exit.

Every rank prints `step rank=R run=RUN_ID`. In the run whose id ends with `-2`, rank 1 exits 3 (the
run fails through a rank exiting non-zero); every other rank of every run exits 0.
"""

from __future__ import annotations

import os
import sys

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402


def main() -> int:
    rank = dist.get_rank()
    run_id = os.environ.get("FLODL_RUN_ID", "")
    dist.barrier()
    print(f"step rank={rank} run={run_id}", flush=True)
    return 3 if run_id.endswith("-2") and rank == 1 else 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
