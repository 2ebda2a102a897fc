"""The healing program (docs/elastic-averaging.md, "Growth and healing"): ranks average a known bundle round
after round, and a walk-in enters the run with the last averaged state.

Round r's bundle of rank k is `arange(4) + 1000 k + r` in float64 (as in elastic_program.py), so the test
recomputes every mean over any set of members. Every round's result (whatever the mode hands the loop) is
printed as `heal-result` straight from the data plane (`wait_round`, wrapped here), with its SHA-256; each
averaging call prints `heal-round` with the membership after it. The ranks of the formed world stop before
round HEAL_GATE_ROUND (`heal-stall`) until the file HEAL_GATE exists, so a test can let a walk-in enter at
exactly that round. A walk-in prints `heal-entry`: the round it entered at, its membership, and the state it
received (`walk_in_state()`), then runs from its entry round. Everyone stops after HEAL_ROUNDS rounds.
HEAL_GATE_RANKS (a comma list) stops only those ranks at the gate: the others deposit the round and wait
in it, so a walk-in arriving then finds a round in progress.
HEAL_START_GATE holds a rank before it starts (before `flodld.run`, so before it connects to its relay)
until that file exists: a walk-in slow to start.
HEAL_READY_GATE holds a rank after it connected to its relay, before its first averaging call (before
`walk_in_state()`), until that file exists (`heal-connected`): a walk-in whose script is slow to set up.
HEAL_EXIT_RANK names a rank of the formed world that fails (exit code 3, `heal-exit`) on reaching the gate
round instead of stopping there: a rank lost on a host that runs on.
HEAL_GATE2_ROUND and HEAL_GATE2 are a second gate that stops every rank, walk-ins included (`heal-stall2`).
With HEAL_MODE (cpu_cadence or cpu_async, cadence HEAL_CADENCE) the rank calls `Averager.step` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import flodld


def digest(tensor: Any) -> str:  # noqa: ANN401  a torch tensor
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def main() -> int:
    import torch

    from flodld.rank.averaging import Averager, all_average, membership, walk_in_state
    from flodld.rank.relay_client import relay_client

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rounds = int(os.environ.get("HEAL_ROUNDS", "8"))
    gate_round = int(os.environ.get("HEAL_GATE_ROUND", "3"))
    gate = Path(os.environ["HEAL_GATE"]) if os.environ.get("HEAL_GATE") else None
    gated = os.environ.get("HEAL_GATE_RANKS")  # the ranks that stop at the gate (default: every one)
    if gated and rank not in {int(r) for r in gated.split(",")}:
        gate = None
    gate2_round = int(os.environ.get("HEAL_GATE2_ROUND", "-1"))
    gate2 = Path(os.environ["HEAL_GATE2"]) if os.environ.get("HEAL_GATE2") else None
    mode = os.environ.get("HEAL_MODE")
    client = relay_client()
    taken = client.wait_round

    def wait_round(number: int, timeout: float | None = None) -> Any:  # noqa: ANN401
        (result,) = taken(number, timeout)
        line = {"rank": rank, "round": number, "sha256": digest(result), "mean": result.tolist()}
        print(f"heal-result {json.dumps(line)}", flush=True)
        return (result,)

    client.wait_round = wait_round  # type: ignore[method-assign,assignment]
    if os.environ.get("HEAL_READY_GATE"):
        print(f"heal-connected rank {rank}", flush=True)
        while not Path(os.environ["HEAL_READY_GATE"]).exists():
            time.sleep(0.05)
    state = walk_in_state()
    entry = client.entry
    first = entry.round if entry is not None else 0
    if entry is not None:
        seen = membership()
        line = {
            "rank": rank,
            "round": entry.round,
            "members": list(seen.members),
            "epoch": seen.epoch,
            "index": seen.index,
            "state_sha256": digest(state[0]) if state is not None else None,
            "state": state[0].tolist() if state is not None else None,
        }
        print(f"heal-entry {json.dumps(line)}", flush=True)
    averager = Averager(mode, cadence=int(os.environ.get("HEAL_CADENCE", "1"))) if mode else None
    cadence = averager.cadence if averager is not None and mode == "cpu_cadence" else 1
    bundle = torch.zeros(4, dtype=torch.float64)
    for number in range(first, rounds):
        if number == gate_round and entry is None and os.environ.get("HEAL_EXIT_RANK") == str(rank):
            print(f"heal-exit rank {rank} before round {number}", flush=True)
            os._exit(3)
        if number == gate_round and gate is not None and entry is None:
            print(f"heal-stall rank {rank} before round {number}", flush=True)
            while not gate.exists():
                time.sleep(0.05)
        if number == gate2_round and gate2 is not None:
            print(f"heal-stall2 rank {rank} before round {number}", flush=True)
            while not gate2.exists():
                time.sleep(0.05)
        bundle = torch.arange(4, dtype=torch.float64) + 1000 * rank + number
        if averager is None:
            all_average([bundle])
        else:
            for _ in range(cadence - 1):
                averager.step([bundle])
            averager.step([bundle])
        seen = membership()
        line = {"rank": rank, "round": number, "members": list(seen.members), "epoch": seen.epoch,
                "index": seen.index, "size": seen.size}  # fmt: skip
        print(f"heal-round {json.dumps(line)}", flush=True)
    if averager is not None:
        averager.finish([bundle])
    return 0


if __name__ == "__main__":
    if os.environ.get("HEAL_START_GATE") and "RANK" in os.environ:  # a rank (the agent runs this file too)
        print(f"heal-sleep rank {os.environ['RANK']}", flush=True)
        while not Path(os.environ["HEAL_START_GATE"]).exists():
            time.sleep(0.05)
    sys.exit(flodld.run(main, init_process_group=False))
