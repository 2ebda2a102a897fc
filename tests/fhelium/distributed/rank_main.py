"""Launcher of one world: import torch once, then fork one real process per rank.

``python rank_main.py SUITE RESULT_DIR WORLD_SIZE RENDEZVOUS``. Forking after the (slow)
torch import keeps a five-rank world cheap on a small machine; each child is an ordinary
process with its own process-group connection. RENDEZVOUS is ``torchrun`` (children get
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``), ``store`` (``init(store=FileStore)``, as a
flodld rank hands over its controller store) or ``none`` (world of one, no variables at all). Each rank writes
``RESULT_DIR/rank-<r>.json`` after every scenario, so a hang leaves the finished ones behind,
and the launcher writes ``exit-codes.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

# torch.distributed re-exports these without `as`, which mypy does not count as exported; this is where
# they are defined (the same class objects as `torch.distributed.FileStore` and `.Store`).
from torch._C._distributed_c10d import FileStore, Store

torch.set_num_threads(1)

# rank_scenarios sits next to this file, and `python rank_main.py` puts this directory first on sys.path
import rank_scenarios  # noqa: E402

import fhelium.distributed as fdist  # noqa: E402


def run_rank(
    suite: str, result_dir: Path, timeout_s: float, store: Store | None, rank: int, world: int
) -> int:
    backend = os.environ.get("FHELIUM_TEST_BACKEND") or None
    if store is None:
        fdist.init(timeout=timedelta(seconds=timeout_s), backend=backend)
    else:
        fdist.init(
            timeout=timedelta(seconds=timeout_s), backend=backend, store=store, rank=rank, world_size=world
        )
    rank = fdist.get_rank()
    context = rank_scenarios.RankContext.create(timeout_s)
    results: dict[str, dict[str, object]] = {}
    out = result_dir / f"rank-{rank}.json"
    for name, scenario in rank_scenarios.SUITES[suite]:
        started = time.monotonic()
        try:
            results[name] = {"ok": True, "data": scenario(context)}
        except Exception as error:  # report every failure; later scenarios still run
            results[name] = {
                "ok": False,
                "error": f"{type(error).__name__}: {error}",
                "trace": traceback.format_exc(),
            }
        results[name]["seconds"] = round(time.monotonic() - started, 3)
        out.write_text(json.dumps(results, default=str))
    fdist.shutdown()
    fdist.shutdown()  # idempotent: a second call is a no-op
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    suite, result_dir, world_size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rendezvous = sys.argv[4]
    timeout_s = float(os.environ.get("FHELIUM_TEST_PG_TIMEOUT", "30"))
    port = free_port()
    children: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = (result_dir / f"rank-{rank}.log").open("w", buffering=1)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                store = None
                # Ranks sharing one GPU (gloo CUDA tests) all use cuda:0.
                local_rank = "0" if os.environ.get("FHELIUM_TEST_SHARED_GPU") == "1" else str(rank)
                if rendezvous == "torchrun":
                    os.environ.update(
                        RANK=str(rank),
                        WORLD_SIZE=str(world_size),
                        LOCAL_RANK=local_rank,
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                    )
                elif rendezvous == "store":
                    os.environ["LOCAL_RANK"] = local_rank
                    store = FileStore(str(result_dir / "rendezvous"), world_size)
                code = run_rank(suite, result_dir, timeout_s, store, rank, world_size)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    exit_codes: dict[int, int] = {}
    while children:
        pid, status = os.wait()
        exit_codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    (result_dir / "exit-codes.json").write_text(json.dumps([exit_codes[r] for r in range(world_size)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
