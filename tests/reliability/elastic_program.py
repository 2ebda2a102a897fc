"""The elastic averaging program: every rank averages a known bundle through the relays, round after round.

Agent and relay roles exit inside `flodld.run` before torch is imported; ranks use no process group (a
process group cannot lose a member). Round r's bundle of rank k is `arange(4) + 1000 k + r` in float64, so
every mean over any set of members is exact up to one correctly rounded division, and the test recomputes
it. Each rank prints one line per round: the members of that round, the membership epoch, its index, the
mean, and the mean's SHA-256. ELASTIC_STALL_RANK stops before depositing round ELASTIC_STALL_ROUND (in
`stall_here`, which a stack dump names), so a test can kill or stop it while the others wait in that
round (with ELASTIC_CRASH set, it SIGKILLs itself there instead). With ELASTIC_SLOW_EXIT_SECS every rank's
interpreter takes that long to finalize after its last round. ELASTIC_LATE_RANK sleeps
ELASTIC_LATE_SECS before depositing round ELASTIC_LATE_ROUND and goes on (a straggler, not a loss); with
ELASTIC_SCALE=4 rank k's bundle is `arange(4) + 1000 * 4**k + r`, so the mean tells which ranks it holds.

With ELASTIC_MODE (cpu_cadence or cpu_async, cadence ELASTIC_CADENCE) the rank calls `Averager.step` once
per step instead, ELASTIC_ROUNDS averaging calls in all; "round" is then the index of the averaging call
(the rank stalls before its ELASTIC_STALL_ROUND-th), and each step line says whether it averaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import flodld


def stall_here() -> None:
    while True:
        time.sleep(0.05)


def main() -> int:
    import torch

    from flodld.rank.averaging import Averager, all_average, membership

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rounds = int(os.environ.get("ELASTIC_ROUNDS", "10"))
    stall = (int(os.environ.get("ELASTIC_STALL_RANK", "-1")), int(os.environ.get("ELASTIC_STALL_ROUND", "3")))
    late = (int(os.environ.get("ELASTIC_LATE_RANK", "-1")), int(os.environ.get("ELASTIC_LATE_ROUND", "3")))
    # ELASTIC_SCALE 4: rank k's bundle is offset by 1000 * 4**k, so every set of members has its own mean
    # (unset: 1000 * k).
    scale = int(os.environ.get("ELASTIC_SCALE", "0"))
    mode = os.environ.get("ELASTIC_MODE")
    averager = Averager(mode, cadence=int(os.environ.get("ELASTIC_CADENCE", "1"))) if mode else None
    cadence = averager.cadence if averager is not None and mode == "cpu_cadence" else 1
    for number in range(rounds):
        if (rank, number) == stall:
            if os.environ.get("ELASTIC_CRASH"):  # a crash of its own, for runs the test cannot reach into
                print(f"elastic-rank {rank} crashes before round {number}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"elastic-rank {rank} stalls before round {number}", flush=True)
            stall_here()
        if (rank, number) == late:  # alive and heartbeating, but late for this round (straggler_timeout)
            print(f"elastic-rank {rank} sleeps before round {number}", flush=True)
            time.sleep(float(os.environ.get("ELASTIC_LATE_SECS", "5")))
        offset = 1000 * scale**rank if scale > 1 else 1000 * rank
        bundle = torch.arange(4, dtype=torch.float64) + offset + number
        if averager is None:
            (mean,) = all_average([bundle])
        else:  # the local steps between averaging calls, then the call that averages
            for _ in range(cadence - 1):
                averager.step([bundle])
            (mean,) = averager.step([bundle])
        seen = membership()
        line = {
            "rank": rank,
            "round": number,
            "members": list(seen.members),
            "epoch": seen.epoch,
            "index": seen.index,
            "mean": mean.tolist(),
            "sha256": hashlib.sha256(mean.numpy().tobytes()).hexdigest(),
        }
        print(f"elastic-round {json.dumps(line)}", flush=True)
        time.sleep(0.05)
    if averager is not None:
        (final,) = averager.finish([bundle])
        print(f"elastic-final {json.dumps({'rank': rank, 'value': final.tolist()})}", flush=True)
    if os.environ.get("ELASTIC_SLOW_EXIT_SECS"):  # a finalization as slow as torch's on a loaded machine
        global _slow_exit
        _slow_exit = SlowExit(float(os.environ["ELASTIC_SLOW_EXIT_SECS"]))
    return 0


class SlowExit:
    """Sleeps in its finalizer: run when the interpreter clears this module, after the atexit handlers,
    once daemon threads (the rank's heartbeats) no longer run.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        time.sleep(self.seconds)


_slow_exit: SlowExit | None = None


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
