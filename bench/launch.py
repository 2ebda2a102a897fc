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
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    stamps = [float(t) for t in re.findall(r"past-init rank=\d+ t=([0-9.]+)", done.stdout + done.stderr)]
    if done.returncode != 0 or len(stamps) != ranks:
        raise RuntimeError(f"{command[:3]} failed (exit {done.returncode}, {len(stamps)}/{ranks} ranks):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return max(stamps) - started


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
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        print("torchrun not found next to this interpreter or on PATH", file=sys.stderr)
        return 2
    print(
        f"{'ranks':>5} {'torchrun s':>11} {'fdl run s':>10} {'fdl/torchrun':>13} {'env:// s':>9} {'env:///torchrun':>16}"
    )
    fdl = [sys.executable, "-m", "fdl.main", "run"]
    for ranks in args.ranks:
        baseline, ours, stock = [], [], []
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits every launcher alike
            baseline.append(
                measure(
                    [torchrun, "--standalone", f"--nproc-per-node={ranks}", str(HERE), "--as-rank"], ranks
                )
            )
            ours.append(measure([*fdl, "--ranks", str(ranks), str(HERE), "--", "--as-rank"], ranks))
            stock.append(
                measure([*fdl, "--ranks", str(ranks), str(HERE), "--", "--as-rank", "--stock"], ranks)
            )
        base, mine, env = statistics.median(baseline), statistics.median(ours), statistics.median(stock)
        print(
            f"{ranks:>5} {base:>11.2f} {mine:>10.2f} {mine / base:>12.2f}x {env:>9.2f} {env / base:>15.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
