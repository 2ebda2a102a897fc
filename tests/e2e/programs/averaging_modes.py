"""Test program: the CPU averaging modes through real relays, on two ranks (tests/e2e/test_averaging.py).

Each part prints one `result <part> <json>` line per rank:
- `mixing`: `all_average` calls interleaved with `cpu_async` `Averager.step` calls of another shape;
  each call's result must be its own round's (a result of the wrong shape ends the program at once);
- `sync` and `async`: the same least-squares problem (`shard`, `gradient`) trained with `cpu_sync` and
  with the run's configured mode (`Averager()`: cpu_async in the test's fdl.yml), final parameters.
The test simulates the documented update rules on the same data and compares.
"""

from __future__ import annotations

import json
import sys

from flodld.launcher import exit_if_worker_role

# Agent and relay roles run and exit here, before the (slow) torch import they do not need.
exit_if_worker_role()

import torch  # noqa: E402

import flodld  # noqa: E402

STEPS = 300
LEARNING_RATE = 0.05
FEATURES = 4


def shard(rank: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s data: deterministic features, targets from a rank-specific weight (heterogeneous)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    features = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    sign = 1.0 if rank == 0 else -1.0
    weight = torch.arange(1.0, FEATURES + 1.0, dtype=torch.float64) + sign * 0.3 * torch.tensor(
        [1.0, -1.0, 1.0, -1.0], dtype=torch.float64
    )
    targets = features @ weight + 0.01 * torch.randn(rows, generator=generator, dtype=torch.float64)
    return features, targets


def gradient(weight: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean squared error on one shard."""
    return 2.0 * features.T @ (features @ weight - targets) / len(targets)


def main() -> int:
    from flodld.rank.averaging import Averager, all_average
    from flodld.rank.env import read_rank_environment

    rank = read_rank_environment().rank

    def report(part: str, value: object) -> None:
        print(f"result {part} {json.dumps({'rank': rank, 'value': value})}", flush=True)

    # Mixing: an all_average round, then async steps of another shape, interleaved with more rounds.
    (metric,) = all_average([torch.tensor([100.0 + rank])])
    averager = Averager("cpu_async", cadence=1)
    steps: list[list[float]] = []
    metrics: list[list[float]] = [metric.tolist()]
    for index in range(5):
        (value,) = averager.step([torch.full((3,), float(10 * index + rank))])
        if value.shape != (3,):
            print(f"crossed: Averager.step of a (3,) tensor returned {value.tolist()}", flush=True)
            return 1
        steps.append(value.tolist())
        (metric,) = all_average([torch.tensor([float(index), float(rank)])])
        if metric.shape != (2,):
            print(f"crossed: all_average of a (2,) tensor returned {metric.tolist()}", flush=True)
            return 1
        metrics.append(metric.tolist())
    (last,) = averager.finish([torch.full((3,), 50.0 + rank)])
    report("mixing", {"steps": steps, "metrics": metrics, "finish": last.tolist()})

    features, targets = shard(rank)
    for part, trainer in (("sync", Averager("cpu_sync")), ("async", Averager())):
        weight = torch.zeros(FEATURES, dtype=torch.float64)
        for _ in range(STEPS):
            weight = weight - LEARNING_RATE * gradient(weight, features, targets)
            (weight,) = trainer.step([weight])
        (weight,) = trainer.finish([weight])
        report(part, {"mode": trainer.mode, "cadence": trainer.cadence, "weight": weight.tolist()})
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
