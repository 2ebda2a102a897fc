"""One rank of a real gloo world running the threshold protocol (driven by test_distributed_threshold.py).

argv: scenario ("mean", "leave:<rank>" or "shape:<rank>": that rank decrypts one row fewer), timeout_s. Prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import fhelium.distributed as fdist
from fhelium.multiparty.distributed import ProcessGroupChannel, ThresholdSession


def update(rank: int, count: int) -> torch.Tensor:
    return torch.rand(count, generator=torch.Generator().manual_seed(7919 + rank), dtype=torch.float64) * 2 - 1


def main() -> int:
    scenario, timeout_s = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    leaver = int(scenario.split(":")[1]) if scenario.startswith("leave:") else None
    misshapen = int(scenario.split(":")[1]) if scenario.startswith("shape:") else None
    started = time.monotonic()
    result: dict[str, object] = {"rank": rank}
    try:
        session = ThresholdSession(ProcessGroupChannel(session="test", timeout_s=timeout_s), session="test")
        session.generate_public_key()
        count = 5000  # two ciphertext rows of 4096 slots
        rows = -(-count // 4096)
        padded = torch.zeros(rows * 4096, dtype=torch.float64)
        padded[:count] = update(rank, count)
        ct = session.encrypt(padded.view(rows, 4096))
        fdist.all_reduce_ciphertext(ct, engine=session.engine)
        if rank == leaver:
            print(json.dumps({"rank": rank, "left": True}), flush=True)
            os._exit(0)  # leaves after encrypting (and after the sum), before its decryption share
        if rank == misshapen:
            from fhelium.core import Ciphertext

            ct = Ciphertext(ct.data[:, :1].contiguous(), ct.depth, ct.scale, ct.prime_ids, "ntt")
        mean = session.decrypt(ct).real.reshape(-1)[:count] / world
        truth = sum(update(r, count) for r in range(world)) / world
        result.update(ok=True, max_error=float((mean - truth).abs().max()))
    except Exception as error:  # report every failure as data
        result.update(ok=False, error=type(error).__name__, message=str(error), trace=traceback.format_exc())
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    if not result.get("ok"):
        time.sleep(3)  # rank 0 hosts the TCPStore: let the others read it before this process goes
    os._exit(0)  # no destroy_process_group: a departed peer would make it wait


if __name__ == "__main__":
    sys.exit(main())
