"""Encrypted mean of every rank's update: CKKS-encrypt, sum across ranks, decrypt collectively.

    fdl run examples/encrypted_mean.py                           # embedded default: 2 CPU ranks, relay path
    fdl run --ranks 3 examples/encrypted_mean.py -- --values 65536
    fdl run examples/encrypted_mean.py -- --transport process-group [--lower]
    fdl run examples/encrypted_mean.py -- --keys single          # rank 0 holds the key (the older mode)
    fdl run --ranks 3 examples/encrypted_mean.py -- --threshold 2  # t-out-of-N: any 2 ranks decrypt

Every rank holds a local update (default 1M float values). With `--keys threshold` (the default)
nobody holds the secret key: the ranks build a collective public key from key shares
(fhelium.multiparty), every rank encrypts its update, the ciphertexts are summed and every rank
publishes a decryption share; the summed shares decrypt the sum on every rank, which divides by the
world size and checks the error bound. On the relay road a compiled rank-local Program
(flodld_fhelium/encrypted_mean.mlir, `all_reduce_add_ciphertext`) sums the ciphertexts; on the process
group the fused protocol (`ThresholdSession.aggregate`: only c1 is summed, each rank publishes its c0
folded into its decryption share) does, unless `--lower` asks for the lowered Program. With
`--keys single`, rank 0 is the key holder and decrypts.
The transport follows the run's averaging mode (`--transport auto`): cpu_* modes use the relays
(the controller folds residues and never holds a key), others the torch process group.
Exit code 0 when the measured error is within the bound, 1 otherwise or on any refusal.
The workload lives in the flodld_fhelium package (the bridge between flodld and fhelium); this file
is the program a user would write on top of it.
"""

from __future__ import annotations

import sys

from flodld.launcher import exit_if_worker_role

# Agent and relay roles run and exit here, before the (slow) torch import they do not need.
exit_if_worker_role()

import torch  # noqa: E402

import flodld  # noqa: E402
from flodld_fhelium.aggregation import aggregate_mean  # noqa: E402
from flodld_fhelium.cli import choose_transport, open_transport, parse_arguments, report  # noqa: E402
from flodld_fhelium.errors import AggregationError  # noqa: E402
from flodld_fhelium.threshold import aggregate_mean_threshold  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv, description=(__doc__ or "").splitlines()[0])
    torch.set_num_threads(1)
    name = choose_transport(args.transport)
    prefix = "encrypted_mean"
    try:
        transport = open_transport(name)
        prefix = f"encrypted_mean rank {transport.rank}/{transport.world_size}"

        def say(message: str) -> None:
            print(f"{prefix}: {message}", flush=True)

        if args.keys == "threshold":
            say(f"transport {name}, {args.values} values, threshold keys (no key holder)")
            outcome = aggregate_mean_threshold(
                transport,
                values=args.values,
                seed=args.seed,
                bound=args.bound,
                lower=args.lower,
                share_timeout_s=args.share_timeout,
                say=say,
                threshold=args.threshold,
            )
        else:
            say(f"transport {name}, {args.values} values, key holder rank 0")
            outcome = aggregate_mean(
                transport, values=args.values, seed=args.seed, bound=args.bound, lower=args.lower, say=say
            )
    except AggregationError as error:
        print(f"{prefix}: FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"{prefix}: {report(outcome, name, args.keys)}", flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
