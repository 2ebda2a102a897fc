"""Encrypted aggregation end to end: ours vs the usual federated-learning pipeline vs the plaintext floor.

    .venv/bin/python bench/aggregate.py                 # 2 and 4 ranks, 1M values (the issue's setting)
    .venv/bin/python bench/aggregate.py --ranks 2 --values 65536
    .venv/bin/python bench/aggregate.py --defence-ratio --repeats 5   # what the sum checks cost
    .venv/bin/python bench/aggregate.py --t-of-n --repeats 3          # t-out-of-N vs N-out-of-N, no dropout
    .venv/bin/python bench/aggregate.py --dealing 64                  # in-process key dealing, 64 parties

``--t-of-n`` runs the fused N-out-of-N aggregate and the t-out-of-N one (t = world - 1, or 1 with one
rank; ``fhelium.multiparty.dropout``: whole ciphertexts summed among the ranks present, checked, then
one Lagrange-scaled decryption share per rank) in alternating pairs, and prints t-of-N / N-of-N per
pair, for the aggregate alone and with key generation (which deals the Shamir points for t-of-N).
``--dealing P`` measures, in one process, key dealing for P simulated parties at threshold P // 2 + 1:
the Shamir polynomial evaluations, sealing every point (X25519 + ChaCha20-Poly1305) and opening and
summing the received ones.

``--defence-ratio`` runs only the threshold pipelines, each with the checks against a malicious fold
(``ThresholdSession.aggregate``) and without them (the bench-only baseline
``ThresholdSession._aggregate(check_sums=False)``, the same protocol trusting the fold), in
alternating pairs, and prints checked / unchecked per pair: median [min-max].

Every configuration runs as P gloo processes on this machine (one torch thread each), in one run:
- floor: gloo all_reduce of the raw float32 updates (the physical lower bound);
- ours: rank 0 generates keys and broadcasts the public key (typed broadcast_key), every rank
  encrypts under the aggregation parameters (one 50-bit Q limb), the compiled Program
  (flodld_fhelium/encrypted_mean.mlir, all_reduce_add_ciphertext) sums, rank 0 decrypts and divides;
- ours, threshold, Program: no key holder (fhelium.multiparty), as the flagship's relay road runs it
  (and its process-group road did before it ran the fused form).
  Committed common seed, collective public key from every rank's committed key share, every rank encrypts
  (two 50-bit Q limbs, scale 2^88), the same compiled Program sums c1-only ciphertexts (c0 zeroed), every
  rank checks the sum and publishes c0_i + its flooded decryption share, the contributions are all-reduced,
  checked, and every rank decodes every row (``ThresholdSession.aggregate(sum_c1=...)``);
- ours, threshold, fused: the same keys, then ``ThresholdSession.aggregate``:
  every rank encrypts (two 50-bit Q limbs, scale 2^88) one slice of rows per rank, the c1 components are
  all-reduced (started per slice while the next is encrypted), every rank publishes c0_i + its flooded
  decryption share per slice, slice k's are summed on rank k, which decodes it, and the decoded real
  slots are all-gathered: every rank ends with the mean;
- usual: the TenSEAL federated-learning shape. Each client encrypts under TenSEAL's tutorial
  parameters (N = 8192, scale 2^40, three Q limbs), serializes, sends the bytes to a server (rank 0),
  which deserializes, adds, serializes back and returns the sum; clients deserialize and decrypt.
  TenSEAL itself is used when importable; otherwise the same pipeline runs on our engine and
  fhelium.serialization, and the table says so.
Times are wall-clock from a barrier to the mean being available, best of interleaved repeats;
ratios are against the floor and between ours and the usual pipeline. Errors are the max absolute error of
the decrypted mean.
The CPU line gives the busiest rank's process CPU seconds over the same span of the same repeats:
on a machine shared with other work the wall-clock ratios move between runs, the CPU ratios much less.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from aggregate_pipelines import (
    floor,
    ours,
    threshold,
    threshold_program,
    usual_on_our_engine,
    usual_with_tenseal,
)
from aggregate_tables import DEFENCE_ROADS, summarize, summarize_defence, summarize_t_of_n

from flodld_fhelium.aggregation import expected_mean, make_update

SEED = 7
DEFENCE_PIPELINES = {"threshold": threshold, "threshold_program": threshold_program}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker(
    rank: int,
    world: int,
    port: int,
    values: int,
    tenseal: bool,
    repeats: int,
    results: Queue[dict[str, Any]],
    defence: bool = False,
    t_of_n: bool = False,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    update = make_update(rank, values, SEED)
    truth = expected_mean(world, values, SEED)
    if t_of_n:
        results.put(t_of_n_row(rank, world, update, truth, repeats))
        dist.barrier()
        dist.destroy_process_group()
        return
    if defence:
        results.put(defence_row(rank, world, update, truth, repeats))
        dist.barrier()
        dist.destroy_process_group()
        return
    usual = usual_with_tenseal if tenseal else usual_on_our_engine
    row: dict[str, Any] = {"rank": rank, "floor": floor(update)}
    row.update({key: [] for key in ("ours", "threshold", "threshold_program", "usual")})
    # Interleaved repeats: load from other processes on the machine hits every pipeline alike.
    for _ in range(repeats):
        row["ours"].append(ours(rank, world, update, truth))
        row["threshold"].append(threshold(rank, world, update, truth))
        row["threshold_program"].append(threshold_program(rank, world, update, truth))
        row["usual"].append(usual(rank, world, update, truth))
    results.put(row)
    dist.barrier()
    dist.destroy_process_group()


def defence_row(
    rank: int, world: int, update: torch.Tensor, truth: torch.Tensor, repeats: int
) -> dict[str, Any]:
    """``repeats`` pairs per road: with the sum checks and without, the order alternating pair by pair
    (checked first in even pairs), so that drifting load on the machine hits both alike.
    """
    row: dict[str, Any] = {"rank": rank}
    for _, key in DEFENCE_ROADS:
        row[key] = {True: [], False: []}
    for index in range(repeats):
        order = (True, False) if index % 2 == 0 else (False, True)
        for _, key in DEFENCE_ROADS:
            for checked in order:
                row[key][checked].append(DEFENCE_PIPELINES[key](rank, world, update, truth, checked))
    return row


def t_of_n_row(
    rank: int, world: int, update: torch.Tensor, truth: torch.Tensor, repeats: int
) -> dict[str, Any]:
    """``repeats`` pairs: the fused N-out-of-N aggregate and the t-out-of-N one, alternating the order."""
    t = max(1, world - 1)
    row: dict[str, Any] = {"rank": rank, "t": t, "n_of_n": [], "t_of_n": []}
    for index in range(repeats):
        order = ("n_of_n", "t_of_n") if index % 2 == 0 else ("t_of_n", "n_of_n")
        for key in order:
            row[key].append(threshold(rank, world, update, truth, True, t if key == "t_of_n" else None))
    return row


def dealing_bench(parties: int) -> None:
    """Key dealing for ``parties`` simulated parties in this process (threshold parties // 2 + 1)."""
    from fhelium.multiparty import ThresholdParty, dealing, shamir

    torch.set_num_threads(1)
    t = parties // 2 + 1
    members = [
        ThresholdParty(rank, parties, session="dealing-bench", rng_seed=rank) for rank in range(parties)
    ]
    seed = bytes(32)
    for member in members:
        member.key_share(seed)
    identities = [dealing.DealingIdentity.generate() for _ in members]
    keys = [identity.public_bytes for identity in identities]
    engine = members[0].engine
    started = time.perf_counter()
    points = [shamir.deal(member, t) for member in members]
    evaluated = time.perf_counter()
    records = [
        dealing.seal_points(
            identities[i], points[i], keys, dealer=i, session="dealing-bench", seed=seed, threshold=t
        )
        for i in range(parties)
    ]
    sealed = time.perf_counter()
    for j, member in enumerate(members):
        received = {j: points[j][j]}
        recipient = dealing.Recipient(identities[j], j, keys)
        for i in range(parties):
            if i != j:
                received[i] = dealing.open_point(
                    recipient, records[i], dealer=i, session="dealing-bench", seed=seed, threshold=t,
                    moduli=engine.moduli, ring_degree=engine.ring_degree,
                )
        shamir.receive(member, received)
    opened = time.perf_counter()
    total = opened - started
    print(
        f"\nkey dealing in process, {parties} parties, threshold {t} (one thread): {total:.2f} s for all "
        f"parties ({total / parties * 1e3:.0f} ms per party): Shamir evaluations "
        f"{evaluated - started:.2f} s, "
        "sealing "
        f"{sealed - evaluated:.2f} s, opening and summing {opened - sealed:.2f} s; each party sends "
        f"{len(records[0]) / 2**20:.1f} MiB ({parties - 1} sealed points of "
        f"{dealing.sealed_bytes(len(engine.moduli), engine.ring_degree) / 1024:.0f} KiB)"
    )


def run(
    world: int, values: int, tenseal: bool, repeats: int, defence: bool = False, t_of_n: bool = False
) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    processes = [
        context.Process(
            target=worker, args=(rank, world, port, values, tenseal, repeats, results, defence, t_of_n)
        )
        for port in [free_port()]
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    rows = [results.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"a bench rank exited with code {process.exitcode}")
    return sorted(rows, key=lambda row: row["rank"])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 20, help="values per rank (default 1048576)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="interleaved repeats per pipeline; the best counts"
    )
    parser.add_argument(
        "--defence-ratio",
        action="store_true",
        help="only the threshold pipelines, each with the sum checks and without them (the fold trusted) "
        "in alternation, --repeats pairs (default 2; 5 or more for a spread); prints checked / unchecked",
    )
    parser.add_argument(
        "--t-of-n", action="store_true", help="only N-of-N vs t-out-of-N aggregation, --repeats pairs"
    )
    parser.add_argument("--dealing", type=int, metavar="P", help="only in-process key dealing for P parties")
    args = parser.parse_args()
    if args.dealing:
        dealing_bench(args.dealing)
        return 0
    if args.t_of_n:
        print(f"cpu threads per rank: 1; machine cores: {os.cpu_count()}; torch {torch.__version__}")
        for world in args.ranks:
            rows = run(world, args.values, False, max(1, args.repeats), t_of_n=True)
            summarize_t_of_n(world, args.values, rows)
        return 0
    if args.defence_ratio:
        print(f"cpu threads per rank: 1; machine cores: {os.cpu_count()}; torch {torch.__version__}")
        for world in args.ranks:
            summarize_defence(world, args.values, run(world, args.values, False, max(1, args.repeats), True))
        return 0
    tenseal = importlib.util.find_spec("tenseal") is not None
    usual_name = "usual: TenSEAL serialize/add" if tenseal else "usual: same shape, our engine"
    print(f"cpu threads per rank: 1; machine cores: {os.cpu_count()}; torch {torch.__version__}")
    if not tenseal:
        print(
            "TenSEAL: unavailable (not installable here); the usual pipeline runs on our engine with "
            "TenSEAL's tutorial parameters and fhelium.serialization for the byte round trips"
        )
    for world in args.ranks:
        summarize(world, args.values, run(world, args.values, tenseal, max(1, args.repeats)), usual_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
