"""A tiny cpu_sync program for the /metrics end-to-end test.

    metrics_rounds.py [--rounds N] [--late-rank R] [--late-secs S]

Every rank averages a small tensor through the relays N times (N rounds); rank R sleeps S seconds
before each of its deposits (a straggler the deposit delays show). Each rank checks the mean, then
waits long enough for a heartbeat to report its last round before it exits.
"""

from __future__ import annotations

import argparse
import sys
import time

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402
from flodld.rank.averaging import all_average  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-rank", type=int, default=1)
    parser.add_argument("--late-secs", type=float, default=0.5)
    parser.add_argument("--linger-secs", type=float, default=1.0)
    args = parser.parse_args()
    rank, world = dist.get_rank(), dist.get_world_size()
    for round_number in range(args.rounds):
        if rank == args.late_rank:
            time.sleep(args.late_secs)
        (mean,) = all_average([torch.full((8,), float(rank + round_number))])
        expected = (world - 1) / 2 + round_number
        if not torch.allclose(mean, torch.full((8,), expected)):
            print(f"rank {rank}: round {round_number} mean {mean.tolist()}, expected {expected}", flush=True)
            return 1
    time.sleep(args.linger_secs)  # a heartbeat (every FLODL_HEARTBEAT_INTERVAL_SECS) reports the last round
    print(f"rank {rank}/{world}: {args.rounds} rounds ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
