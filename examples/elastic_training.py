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

Growth (docs/elastic-averaging.md, "Growth and healing"): with `controller.join.elastic_max_ranks` (or
`fdl @cluster run --nnodes MIN:MAX`), a host that joins while the run trains enters at a round boundary:

    fdl @cluster run examples/elastic_training.py --steps 600 --pause 0.05
    fdl join HOST:PORT --bin examples/elastic_training.py     # on the new host, mid-run

Its ranks start from the averaged weights every member holds (`walk_in_state()`), count their steps from
the round they entered at (`entry_round()`), and everyone reshards over the grown membership.
`--pause-until 3` pauses between steps only until the third rank has walked in, then trains at full speed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()  # agent and relay roles run and exit here, before the torch import

import torch  # noqa: E402

import flodld  # noqa: E402
from flodld.rank.averaging import Averager, Membership, entry_round, membership, walk_in_state  # noqa: E402

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
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between steps (time to walk in)")
    parser.add_argument(
        "--pause-until",
        type=int,
        default=0,
        metavar="MEMBERS",
        help="pause only while fewer than MEMBERS ranks average (then train at full speed); 0: always",
    )
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)

    features, targets = dataset()
    weights = torch.zeros(FEATURES, dtype=torch.float64)
    averager = Averager()
    state = walk_in_state()  # a walk-in: the weights every member averaged last; None otherwise
    if state is not None:
        (weights,) = state
    first = entry_round() * averager.cadence  # a walk-in joins the others' step count
    seen = membership()
    mine = shard(seen, features, targets)
    if first:
        print(f"rank {rank}: walked in at step {first}, shard {seen.index + 1} of {seen.size}", flush=True)
    for step in range(first, args.steps):
        if rank == args.crash_rank and step == args.crash_step:
            print(f"rank {rank}: crashing before step {step} (--crash-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = mine
        gradient = x.T @ (x @ weights - y) / len(y)
        (weights,) = averager.step([weights - args.lr * gradient])
        now = membership()
        if now.size < args.pause_until or not args.pause_until:
            time.sleep(args.pause)
        if now.epoch != seen.epoch:  # a rank lost or walked in: split the data among the members again
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
