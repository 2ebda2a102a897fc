"""Typed ciphertext collectives vs raw torch.distributed on the same bytes (gloo, CPU).

Run: ``.venv/bin/python bench/collectives.py`` (options: ``--sizes 2,3,4 --runs 20 --batch 16``).

For each world size P it forks P real ranks (gloo over 127.0.0.1), builds an N=2^14, 5-limb
ciphertext (1.25 MiB; and a batch of 16, 20 MiB) and times, per iteration, the slowest rank:

- ``all_reduce_ciphertext`` with its default schedule (``"sum"`` here: one SUM all-reduce plus a
  per-limb remainder) and with ``algorithm="tree"`` (binomial tree + engine.add_ + broadcast),
  against raw ``all_reduce(SUM)`` of an int64 tensor of the same shape (wrong for ciphertexts
  on its own, but the transport floor);
- ``reduce_ciphertext`` against the same raw all-reduce and against raw ``reduce(SUM)``;
- ``broadcast_ciphertext`` against raw ``broadcast``.

The operations take turns within every iteration (round robin), so load bursts on a shared
machine hit a typed call and its baseline alike. Medians are printed with the ratio typed/raw
measured in the same run. Goal from the issue:
ciphertext all-reduce within 1.5x of raw gloo all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import fhelium.distributed as fdist  # noqa: E402
from fhelium.core import Ciphertext  # noqa: E402
from fhelium.engine import CkksEngine, Preset  # noqa: E402

RING_DEGREE = 2**14
LIMBS = 5


def _timed_round_robin(
    steps: dict[str, Callable[[], object]], *, warmup: int, runs: int
) -> dict[str, float]:
    """Median over runs of the slowest rank's time per call, in milliseconds.

    The operations take turns within every iteration, so a burst of load on this shared
    machine hits the typed call and its raw baseline alike instead of skewing one of them.
    """
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(warmup + runs):
        for name, step in steps.items():
            fdist.barrier()
            started = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            fdist.all_reduce(elapsed, op=fdist.ReduceOp.MAX)
            if index >= warmup:
                samples[name].append(float(elapsed.item()) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _measure(engine: CkksEngine, batch_shape: tuple[int, ...], warmup: int, runs: int) -> dict[str, float]:
    """Typed and raw timings on one payload shape (every rank calls this with the same shape)."""
    rank = fdist.get_rank()
    prime_ids = engine.q_ids_at(0)
    shape = (2, *batch_shape, LIMBS, RING_DEGREE)
    moduli = torch.tensor(engine.moduli_for(prime_ids), dtype=torch.int64).reshape(-1, 1)
    generator = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 2**62, shape, generator=generator, dtype=torch.int64) % moduli
    value = Ciphertext(data, 0, engine.default_scale, prime_ids, "ntt")
    other = value.clone()
    raw = data.clone()
    source = value if rank == 0 else None
    steps: dict[str, Callable[[], object]] = {
        "all_reduce_ciphertext": lambda: fdist.all_reduce_ciphertext(value, engine=engine),
        "all_reduce_ciphertext[tree]": lambda: fdist.all_reduce_ciphertext(
            value, engine=engine, algorithm="tree"
        ),
        "reduce_ciphertext": lambda: fdist.reduce_ciphertext(value, dst=0, engine=engine),
        "broadcast_ciphertext": lambda: fdist.broadcast_ciphertext(source, src=0),
        "raw_all_reduce_sum": lambda: fdist.all_reduce(raw),
        "raw_reduce_sum": lambda: fdist.reduce(raw, dst=0),
        "raw_broadcast": lambda: fdist.broadcast(raw, src=0),
        "local_add_": lambda: engine.add_(value, other),
    }
    return _timed_round_robin(steps, warmup=warmup, runs=runs)


def _rank_main(batch: int, warmup: int, runs: int, out: Path) -> None:
    fdist.init(timeout=timedelta(seconds=120))
    engine = CkksEngine(Preset.SLOTS8192_SCALE40_DEPTH4, rng_seed=fdist.get_rank())
    assert len(engine.q_ids_at(0)) == LIMBS
    results: dict[str, float] = {}
    for label, batch_shape in (("single", ()), (f"batch{batch}", (batch,))):
        for name, milliseconds in _measure(engine, batch_shape, warmup, runs).items():
            results[f"{label}/{name}"] = milliseconds
    if fdist.get_rank() == 0:
        out.write_text(json.dumps(results))
    fdist.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(world_size: int, batch: int, warmup: int, runs: int) -> dict[str, float]:
    """Fork ``world_size`` ranks (after the torch import) and return rank 0's medians."""
    out = Path(tempfile.mkdtemp(prefix="fhelium-bench-")) / "results.json"
    port = str(_free_port())
    children = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(
                    RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                )  # fmt: skip
                _rank_main(batch, warmup, runs, out)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    failed = [pid for pid in children if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    if failed:
        raise SystemExit(f"world of {world_size}: {len(failed)} rank(s) failed")
    results: dict[str, float] = json.loads(out.read_text())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,3,4", help="comma-separated world sizes (default 2,3,4)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    payload = 2 * LIMBS * RING_DEGREE * 8
    print(
        f"ciphertext: N=2^14, {LIMBS} limbs, {payload / 2**20:.2f} MiB; batch of {args.batch}: "
        f"{payload * args.batch / 2**20:.1f} MiB; gloo on 127.0.0.1; "
        f"medians of {args.runs} runs, slowest rank"
    )
    header = (
        f"{'P':>2} {'payload':<8} {'operation':<27} {'typed ms':>9} {'raw op':<16} {'raw ms':>8} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    pairs = (
        ("all_reduce_ciphertext", "raw_all_reduce_sum"),
        ("all_reduce_ciphertext[tree]", "raw_all_reduce_sum"),
        ("reduce_ciphertext", "raw_all_reduce_sum"),
        ("reduce_ciphertext", "raw_reduce_sum"),
        ("broadcast_ciphertext", "raw_broadcast"),
    )
    for world_size in (int(s) for s in args.sizes.split(",")):
        results = run_world(world_size, args.batch, args.warmup, args.runs)
        for label in ("single", f"batch{args.batch}"):
            for typed, raw in pairs:
                typed_ms, raw_ms = results[f"{label}/{typed}"], results[f"{label}/{raw}"]
                print(
                    f"{world_size:>2} {label:<8} {typed:<27} {typed_ms:>9.3f} {raw.removeprefix('raw_'):<16} "
                    f"{raw_ms:>8.3f} {typed_ms / raw_ms:>6.2f}"
                )
            print(
                f"{world_size:>2} {label:<8} {'(local engine.add_)':<27} "
                f"{results[f'{label}/local_add_']:>9.3f}"
            )


if __name__ == "__main__":
    main()
