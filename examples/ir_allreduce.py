"""Run the rank-local IR Program examples/ir_allreduce.mlir on every rank and check it by decryption.

Each rank receives the same encrypted vector x (encrypted on rank 0, broadcast as a ciphertext),
adds x once per index of its own interval [rank * chunk, (rank + 1) * chunk), and all ranks then sum
their partial ciphertexts. Every rank decrypts the result and checks it equals world * chunk * x.

    fdl run --ranks 3 examples/ir_allreduce.py                      # under flodld
    torchrun --nproc-per-node 3 examples/ir_allreduce.py            # torchrun-style env vars
    python examples/ir_allreduce.py --lower                         # one rank, generic all_reduce form

The demo keys come from a fixed seed so every rank can decrypt; a real deployment would keep the
secret key with its owner.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fhelium.distributed as fdist
import flodld
from fhelium.backend import BoundResource, OperationBackend, default_registry
from fhelium.backend.distributed import bind_process_group
from fhelium.compile import Pipeline
from fhelium.compile.passes import LowerSpecializedCollectivesPass
from fhelium.engine import CkksEngine, Preset
from fhelium.ir import Program

PROGRAM = Path(__file__).with_name("ir_allreduce.mlir")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--chunk", type=int, default=2, help="loop iterations per rank")
    parser.add_argument("--lower", action="store_true", help="lower to the generic all_reduce form first")
    parser.add_argument("--preset", default=Preset.TOY_N1024.value, help="CKKS parameter preset")
    args = parser.parse_args()
    torch.set_num_threads(1)

    fdist.init()  # no-op under flodld (already initialised); env:// or a world of one otherwise
    rank, world = fdist.get_rank(), fdist.get_world_size()
    engine = CkksEngine(args.preset, rng_seed=2026)
    secret = engine.generate_secret_key()
    public = engine.generate_public_key(secret)

    values = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64)
    x = engine.encode_encrypt(values, public) if rank == 0 else None
    x = fdist.broadcast_ciphertext(x, src=0)

    program = Program.load(PROGRAM)
    if args.lower:
        program, _ = Pipeline([LowerSpecializedCollectivesPass()]).run(program)
    backend = OperationBackend(
        default_registry(), [bind_process_group(), BoundResource("rns", "rns-moduli", engine)]
    )
    (total,) = backend.link(program).run(x, args.chunk)

    decoded = engine.decrypt_decode(total, secret)[: values.numel()].real
    expected = values * (world * args.chunk)
    error = float((decoded - expected).abs().max())
    ok = error < 1e-3
    form = "generic all_reduce" if args.lower else "all_reduce_add_ciphertext"
    print(f"rank {rank}/{world}: {form} decrypts to world*chunk*x (max error {error:.2e}): {ok}", flush=True)
    fdist.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(flodld.run(main))
