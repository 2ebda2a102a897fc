"""DDP training-step throughput: the same stock script under `torchrun --standalone` and `fdl run`.

    .venv/bin/python bench/ddp_step.py [--ranks 2 4] [--steps 200] [--repeats 3]

The script (this file with --as-rank) is a stock torchrun program: `init_process_group("gloo")` over
env://, a small MLP wrapped in DistributedDataParallel on CPU, fixed random batches, SGD. After
`--warmup` steps every rank times `--steps` steps between two barriers. We report, per launcher, the
median over repeats of the world's steps/s (the slowest rank's) and the ratio fdl/torchrun, measured in
the same run. Under `fdl run` the rendezvous goes through the agent's loopback TCPStore endpoint; the
steps themselves are gloo between the ranks, as under torchrun.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from launchers import fdl_run_command, find_torchrun, rank_figures, torchrun_command

HERE = Path(__file__).resolve()
WIDTH = 512
BATCH = 64


def as_rank(steps: int, warmup: int) -> int:
    """The benchmarked program: DDP steps on a small MLP; prints this rank's steps/s."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10),
    ))  # fmt: skip
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(8, BATCH, WIDTH, generator=generator)
    targets = torch.randint(0, 10, (8, BATCH), generator=generator)
    loss_fn = nn.CrossEntropyLoss()

    def step(index: int) -> None:
        optim.zero_grad(set_to_none=True)
        loss_fn(model(inputs[index % 8]), targets[index % 8]).backward()
        optim.step()

    for index in range(warmup):
        step(index)
    dist.barrier()
    started = time.perf_counter()
    for index in range(steps):
        step(index)
    dist.barrier()
    elapsed = time.perf_counter() - started
    print(f"ddp-step rank={rank} steps_per_s={steps / elapsed:.3f}", flush=True)
    dist.destroy_process_group()
    return 0


def measure(command: list[str], ranks: int) -> float:
    """The world's steps/s in one launch: the slowest rank's."""
    return min(rank_figures(command, ranks, r"ddp-step rank=\d+ steps_per_s=([0-9.]+)", timeout=900))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank_args = ["--as-rank", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.as_rank:
        return as_rank(args.steps, args.warmup)
    torchrun = find_torchrun()
    if torchrun is None:
        return 2
    print(
        f"MLP {WIDTH}x{WIDTH}x{WIDTH}x10, batch {BATCH}, {args.steps} steps after {args.warmup} warm-up, "
        f"gloo on CPU, median of {args.repeats}"
    )
    print(f"{'ranks':>5} {'torchrun steps/s':>17} {'fdl run steps/s':>16} {'fdl/torchrun':>13}")
    for ranks in args.ranks:
        baseline, ours = [], []
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits both launchers alike
            baseline.append(measure(torchrun_command(torchrun, ranks, HERE, *rank_args), ranks))
            ours.append(measure(fdl_run_command(ranks, HERE, *rank_args), ranks))
        base, mine = statistics.median(baseline), statistics.median(ours)
        print(f"{ranks:>5} {base:>17.1f} {mine:>16.1f} {mine / base:>12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
