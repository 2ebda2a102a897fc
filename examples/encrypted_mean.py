"""Encrypted mean of every rank's update: CKKS-encrypt, sum across ranks, decrypt collectively.

    fdl run examples/encrypted_mean.py                           # embedded default: 2 CPU ranks, relay path
    fdl run --ranks 3 examples/encrypted_mean.py -- --values 65536
    fdl run examples/encrypted_mean.py -- --transport process-group [--lower]
    fdl run examples/encrypted_mean.py -- --keys single          # rank 0 holds the key (the older mode)

Every rank holds a local update (default 1M float values). With `--keys threshold` (the default)
nobody holds the secret key: the ranks build a collective public key from key shares
(fhelium.multiparty), every rank encrypts its update, the ciphertexts are summed and every rank
publishes a decryption share; the summed shares decrypt the sum on every rank, which divides by the
world size and checks the error bound. On the relay road a compiled rank-local Program
(examples/encrypted_mean.mlir, `all_reduce_add_ciphertext`) sums the ciphertexts; on the process
group the fused protocol (`ThresholdSession.aggregate`: only c1 is summed, each rank publishes its c0
folded into its decryption share) does, unless `--lower` asks for the lowered Program. With
`--keys single`, rank 0 is the key holder and decrypts.
The transport follows the run's averaging mode (`--transport auto`): cpu_* modes use the relays
(the controller folds residues and never holds a key), others the torch process group.
Exit code 0 when the measured error is within the bound, 1 otherwise or on any refusal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flodld.launcher import exit_if_worker_role

# Agent and relay roles run and exit here, before the (slow) torch import they do not need.
exit_if_worker_role()

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from encrypted_aggregation import (  # noqa: E402
    DEFAULT_ERROR_BOUND,
    AggregationError,
    Outcome,
    ProcessGroupTransport,
    RelayTransport,
    Transport,
    aggregate_mean,
)
from threshold_aggregation import aggregate_mean_threshold  # noqa: E402

import flodld  # noqa: E402

DEFAULT_VALUES = 1 << 20


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--values", type=int, default=DEFAULT_VALUES, help="values per update (default 1048576)"
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "relay", "process-group"),
        default="auto",
        help="auto: relays under a cpu_* averaging mode, else the process group",
    )
    parser.add_argument(
        "--keys",
        choices=("threshold", "single"),
        default="threshold",
        help="threshold: no key holder, every rank decrypts with its share (default); "
        "single: rank 0 holds the secret key",
    )
    parser.add_argument(
        "--share-timeout",
        type=float,
        default=120.0,
        help="threshold: seconds to wait for every rank's key or decryption share before failing",
    )
    parser.add_argument(
        "--lower", action="store_true", help="run the lowered (generic all_reduce) Program form"
    )
    parser.add_argument(
        "--bound", type=float, default=DEFAULT_ERROR_BOUND, help="largest accepted absolute error"
    )
    parser.add_argument("--seed", type=int, default=2026, help="seed of the synthetic updates")
    args = parser.parse_args(argv)
    if args.values < 1:
        parser.error(f"--values must be at least 1, got {args.values}")
    return args


def choose_transport(requested: str) -> str:
    if requested != "auto":
        return requested
    from flodld.rank.env import in_flodld_rank, read_rank_environment

    if in_flodld_rank():
        env = read_rank_environment()
        if env.averaging.startswith("cpu_") and env.relay_port is not None:
            return "relay"
    return "process-group"


def open_transport(name: str) -> Transport:
    if name == "relay":
        return RelayTransport()
    import fhelium.distributed as fdist
    from flodld.rank import in_flodld_rank, init_process_group

    if in_flodld_rank():
        init_process_group()
    else:
        fdist.init()  # torchrun-style variables, or a world of one
    return ProcessGroupTransport()


def report(outcome: Outcome, transport: str, keys: str = "single") -> str:
    phases = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in outcome.timings.phases.items())
    how = "checked here" if outcome.checked_locally else "as measured by the key holder"
    verdict = "PASS" if outcome.ok else "FAIL"
    return (
        f"encrypted mean {verdict}: max error {outcome.max_error:.3e} (bound {outcome.bound:.0e}, {how}) "
        f"over {outcome.values} values, {outcome.world_size} ranks, transport {transport} keys {keys} "
        f"[{phases}]"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
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
