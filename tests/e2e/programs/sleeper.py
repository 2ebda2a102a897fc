"""Test program: ranks join, report, then either exit with a chosen code or sit in a blocking wait.

Usage: sleeper.py [--fail-rank R --code C]. Every rank prints `ready rank=.. pid=.. ppid=..`; rank R
exits with C once all ranks are ready; the others block (as in a collective that never completes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--code", type=int, default=3)
    args = parser.parse_args()
    rank = dist.get_rank()
    dist.barrier()
    print(f"ready rank={rank} pid={os.getpid()} ppid={os.getppid()}", flush=True)
    if rank == args.fail_rank:
        code: int = args.code
        return code
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main))
