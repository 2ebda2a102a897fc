"""Elastic data-parallel training: average through the relays, reshard when a rank is lost.

Every rank fits the same least-squares model to its shard of one synthetic dataset and averages its
weights with the others after every step (`Averager`, the run's CPU mode). The shard is chosen by the
rank's position among the ranks that averaged last (`membership()`), not by RANK: when a rank is lost
the survivors see a new membership epoch and split the whole dataset among themselves again.

Run it with a tolerance, so the run survives a lost rank (docs/elastic-averaging.md):

    # fdl.yml: controller: {averaging: cpu_sync, tolerance: 1}
    fdl run --ranks 3 examples/elastic_training.py --crash-rank 1 --crash-step 20

`--crash-rank R --crash-step S` makes rank R kill itself before step S, to see it happen; the others
print the new membership and finish. Outside flodld (`python examples/elastic_training.py`) it trains
alone: a world of one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()  # agent and relay roles run and exit here, before the torch import

import torch  # noqa: E402

import flodld  # noqa: E402
from flodld.rank.averaging import Averager, Membership, membership  # noqa: E402

SAMPLES, FEATURES = 4096, 8


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank (a fixed seed): y = X w* + noise."""
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    truth = torch.arange(1, FEATURES + 1, dtype=torch.float64)
    targets = features @ truth + 0.01 * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)
    return features, targets


def shard(
    seen: Membership, features: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of the data among the current members."""
    per = SAMPLES // seen.size
    start = seen.index * per
    stop = SAMPLES if seen.index == seen.size - 1 else start + per
    return features[start:stop], targets[start:stop]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--crash-rank", type=int, default=-1, help="this rank kills itself (a demo)")
    parser.add_argument("--crash-step", type=int, default=20)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)

    features, targets = dataset()
    weights = torch.zeros(FEATURES, dtype=torch.float64)
    averager = Averager()
    seen = membership()
    mine = shard(seen, features, targets)
    for step in range(args.steps):
        if rank == args.crash_rank and step == args.crash_step:
            print(f"rank {rank}: crashing before step {step} (--crash-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = mine
        gradient = x.T @ (x @ weights - y) / len(y)
        (weights,) = averager.step([weights - args.lr * gradient])
        now = membership()
        if now.epoch != seen.epoch:  # a rank was lost: split the whole dataset among the survivors again
            print(f"rank {rank}: step {step}: members {list(now.members)} (epoch {now.epoch}), "
                  f"my shard {now.index + 1} of {now.size}", flush=True)  # fmt: skip
            seen, mine = now, shard(now, features, targets)
    (weights,) = averager.finish([weights])
    loss = float(((features @ weights - targets) ** 2).mean())
    print(
        f"rank {rank}: done after {args.steps} steps, members {list(seen.members)}, loss {loss:.6f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
