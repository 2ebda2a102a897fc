"""Launch latency: from launch to every rank past init_process_group, `fdl run` vs `torchrun --standalone`.

    .venv/bin/python bench/launch.py [--ranks 2 4] [--repeats 3]

Both launchers start the same program (this file with --as-rank) on N CPU gloo ranks; each rank
prints the wall time at which init_process_group returned. We report the median over repeats of
(last rank past init − launch) per launcher and the ratio fdl/torchrun, measured in the same run:
`fdl run` with the ranks on flodld's own rendezvous (`flodld.rank.init_process_group`, the controller
store directly), and `fdl run` with a stock `init_process_group("gloo")` over env:// (through the
agent's loopback TCPStore endpoint), the column `env://`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from launchers import fdl_run_command, find_torchrun, rank_figures, torchrun_command

HERE = Path(__file__).resolve()


def as_rank(stock: bool) -> int:
    """The benchmarked program: init the process group, report when, leave."""
    from flodld.launcher import exit_if_worker_role

    exit_if_worker_role()
    import torch.distributed as dist

    if "FLODL_CONTROLLER" in os.environ and not stock:
        from flodld.rank import init_process_group

        init_process_group()
    else:
        dist.init_process_group("gloo")
    print(f"past-init rank={dist.get_rank()} t={time.time():.6f}", flush=True)
    dist.barrier()  # nobody leaves while a peer may still be wiring its side of the mesh
    dist.destroy_process_group()
    return 0


def measure(command: list[str], ranks: int) -> float:
    """Seconds from the launch to the last rank past init_process_group."""
    started = time.time()
    return max(rank_figures(command, ranks, r"past-init rank=\d+ t=([0-9.]+)", timeout=600)) - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.as_rank:
        return as_rank(args.stock)
    torchrun = find_torchrun()
    if torchrun is None:
        return 2
    print(
        f"{'ranks':>5} {'torchrun s':>11} {'fdl run s':>10} {'fdl/torchrun':>13} {'env:// s':>9} {'env:///torchrun':>16}"
    )
    for ranks in args.ranks:
        baseline, ours, stock = [], [], []
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits every launcher alike
            baseline.append(measure(torchrun_command(torchrun, ranks, HERE, "--as-rank"), ranks))
            ours.append(measure(fdl_run_command(ranks, HERE, "--as-rank"), ranks))
            stock.append(measure(fdl_run_command(ranks, HERE, "--as-rank", "--stock"), ranks))
        base, mine, env = statistics.median(baseline), statistics.median(ours), statistics.median(stock)
        print(
            f"{ranks:>5} {base:>11.2f} {mine:>10.2f} {mine / base:>12.2f}x {env:>9.2f} {env / base:>15.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
