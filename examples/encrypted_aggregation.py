"""An encrypted sum with one key holder, step by step with the bridge's pieces (flodld_fhelium).

    fdl run examples/encrypted_aggregation.py                          # 2 CPU ranks, relay road
    fdl run --ranks 3 examples/encrypted_aggregation.py -- --values 4096
    fdl run examples/encrypted_aggregation.py -- --transport process-group

`flodld_fhelium.aggregation.aggregate_mean` runs this workload with checks and timings
(examples/encrypted_mean.py --keys single); here are its steps, for a program of your own. Rank 0
holds the secret key and sends the public key to every rank; each rank encrypts its update; the
compiled Program (flodld_fhelium/encrypted_mean.mlir, one `all_reduce_add_ciphertext`) sums the
ciphertexts, linked to the transport's world: on the relay road `RelayCiphertextAllReduce` deposits
the residues at this host's relay and flodld's keyless modular fold adds them (the relays and the
controller see moduli and residues only); on the process group fhelium's collectives do. Rank 0
decrypts the sum and checks the mean against the plaintext one (a demo's oracle: the updates are
seeded). Exit code 0 when the mean is within the bound, 1 otherwise or on a refusal.
"""

from __future__ import annotations

import argparse
import sys

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()  # agent and relay roles run and exit here, before torch

import torch  # noqa: E402

import flodld  # noqa: E402
from fhelium.engine import CkksEngine  # noqa: E402
from flodld_fhelium.aggregation import (  # noqa: E402
    AGGREGATION_PARAMETERS,
    DEFAULT_ERROR_BOUND,
    decrypt_mean,
    encrypt_update,
    expected_mean,
    link_program,
    make_update,
)
from flodld_fhelium.cli import choose_transport, open_transport  # noqa: E402
from flodld_fhelium.errors import AggregationError  # noqa: E402
from flodld_fhelium.transport import KEY_HOLDER  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 16, help="values per rank (default 65536)")
    parser.add_argument("--transport", choices=("auto", "relay", "process-group"), default="auto")
    parser.add_argument("--seed", type=int, default=2026, help="seed of the synthetic updates")
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = choose_transport(args.transport)
    try:
        transport = open_transport(name)
        rank, world = transport.rank, transport.world_size
        engine = CkksEngine(AGGREGATION_PARAMETERS)
        secret = engine.generate_secret_key() if rank == KEY_HOLDER else None
        public = transport.broadcast_public_key(
            engine.generate_public_key(secret) if secret is not None else None, engine
        )  # addition needs no evaluation key: only the public key travels
        update = make_update(rank, args.values, args.seed)
        ciphertext = encrypt_update(engine, update, public, world_size=world)
        executable = link_program(transport, engine, lower=False)
        (total,) = executable.run(ciphertext)  # the world's sum, still encrypted
    except AggregationError as error:
        print(f"encrypted_aggregation: FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    if secret is None:
        nbytes = ciphertext.data.numel() * ciphertext.data.element_size()
        print(f"rank {rank}/{world}: encrypted {args.values} values into {nbytes} bytes", flush=True)
        return 0
    mean = decrypt_mean(engine, total, secret, args.values, world)
    worst = float((mean - expected_mean(world, args.values, args.seed)).abs().max())
    verdict = "PASS" if worst <= DEFAULT_ERROR_BOUND else "FAIL"
    print(f"rank {rank}/{world}: encrypted sum {verdict}: mean's max error {worst:.2e} ({name})", flush=True)
    return 0 if worst <= DEFAULT_ERROR_BOUND else 1


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
