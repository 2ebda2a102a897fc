"""The rank program of bench/chaos.py: a small MLP trained with `cpu_sync` averaging after every step.

Every rank of the formed world starts from the same weights (a fixed seed), a walk-in from the averaged
weights it is handed as it enters; each takes one SGD step on its own synthetic batch, then averages its
parameters with the others through flodld (`all_average`; no torch process group, so
the run can lose ranks). One extra scalar rides in every round: this rank's vote to stop (1 once
`--duration` seconds have passed since its first round). Every rank receives the same mean, so every
survivor sees the vote in the same round and stops after it: the run ends together without a barrier. A
walk-in whose state (the last averaged result) already carries the vote entered after that round and
stops at once (its persist loop may dial in again just as the others finish).

Per round each rank appends one JSON line to OUT/<run id>/r<rank>-<pid>.jsonl: the data plane's round
number, the wall time the round's result arrived, the samples this rank trained on since its last line,
the members of the round, and the SHA-256 of the averaged bytes (every survivor must hold the same).
The first line is a header: rank, host, pid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()  # agent and relay roles run and exit here, before the torch import

import torch  # noqa: E402

import flodld  # noqa: E402
from flodld.rank.averaging import all_average, membership, walk_in_state  # noqa: E402
from flodld.rank.env import in_flodld_rank  # noqa: E402
from flodld.rank.relay_client import relay_client  # noqa: E402

FEATURES, HIDDEN, BATCH = 32, 64, 64


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same starting weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for the per-rank round logs")
    parser.add_argument("--duration", type=float, required=True, help="seconds of training")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    run_id = os.environ.get("FLODL_RUN_ID", "solo")
    directory = args.out / run_id
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / f"r{rank}-{os.getpid()}.jsonl").open("a", buffering=1)
    host = os.environ.get("FLODL_HOST_NAME", socket.gethostname())
    log.write(json.dumps({"header": True, "rank": rank, "host": host, "pid": os.getpid()}) + "\n")

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1000 + rank)
    truth = torch.linspace(-1, 1, FEATURES)
    params = [p.data for p in net.parameters()]
    if in_flodld_rank() and relay_client().env.walk_in:
        # A walk-in: one throwaway step first (a fresh process's first step pays for lazy set-up), then say
        # it is ready and start from the averaged weights, so the round it enters at waits only for a
        # warm step (docs/elastic-averaging.md, "What the loop must do").
        net(torch.randn(BATCH, FEATURES)).sum().backward()
        state = walk_in_state()
        if state is not None:
            if float(state[-1]) > 0:  # it entered after the others' last round: the run is over
                log.close()
                return 0
            for target, value in zip(params, state[:-1], strict=True):  # the last entry: the stop vote
                target.copy_(value)
    started: float | None = None
    samples = 0
    while True:
        features = torch.randn(BATCH, FEATURES, generator=generator)
        targets = (features @ truth).sin().unsqueeze(1)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(features), targets).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        samples += BATCH
        vote = 1.0 if started is not None and time.time() - started >= args.duration else 0.0
        averaged = all_average([*params, torch.tensor([vote])])
        now = time.time()
        started = now if started is None else started
        for target, value in zip(params, averaged[:-1], strict=True):
            target.copy_(value)
        digest = hashlib.sha256()
        for tensor in averaged:
            digest.update(tensor.numpy().tobytes())
        line = {
            "round": relay_client().next_round - 1 if in_flodld_rank() else -1,
            "t": now,
            "samples": samples,
            "members": list(membership().members),
            "sha": digest.hexdigest()[:16],
        }
        log.write(json.dumps(line) + "\n")
        samples = 0
        if float(averaged[-1]) > 0:  # somebody's time is up: everyone stops after this same round
            log.close()
            return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
