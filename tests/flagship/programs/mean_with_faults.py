"""examples/encrypted_mean.py with one misbehaving rank, and an audit dump, for the flagship tests.
The workload and its command line come from the bridge (flodld_fhelium), as the example's do.

    mean_with_faults.py [example args] [--keys single|threshold] [--fault values|scale|foreign-key|leave
                        --fault-rank R] [--audit-dir D]
                        (t-out-of-N also: --fault leave-early|leave-mid [--leave-by exit|kill])
                        [--malicious-fold substitute|subset|scaled|negated|split]

The faulty rank runs the real workload and only differs where the fault says: a different
--values, a different CKKS scale, a public key of its own, or leaving (exit 0) right before the
all-reduce (single keys) or right after encrypting and summing, before its decryption share
(threshold keys). --keys defaults to single here (the example's own default is threshold).
--audit-dir writes each rank's secret key or secret share, update, ciphertext, sum and (threshold)
decryption share as torch files so a test can compare them with the bytes that crossed the controller.
With threshold keys, --leave-by kill makes the leaving rank SIGKILL itself instead of exiting 0 (run it
with a tolerance, docs/elastic-averaging.md, so that its host-mates keep running).
--malicious-fold plays the controller's fold as an attacker against rank --fault-rank (relay road).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch  # noqa: E402

import flodld  # noqa: E402
from fhelium.core import PublicKey  # noqa: E402
from fhelium.engine import CkksEngine  # noqa: E402
from flodld_fhelium import aggregation, cli, threshold  # noqa: E402
from flodld_fhelium.errors import AggregationError  # noqa: E402
from flodld_fhelium.relay import RelayTransport  # noqa: E402


def play_malicious_fold(transport: RelayTransport, attack: str, *, victim: int) -> None:
    """The controller's fold as an attacker, played in every rank's relay client (every rank runs this).

    The first aggregation round whose frames are ciphertexts (``[2, rows, limbs, N]``: the Program's
    sum; with t-out-of-N keys the whole ciphertexts' sum) is answered with the victim's own frame
    ("substitute"), with the sum minus the victim's ("subset", the all-but-one sum whose difference with
    the true sum isolates the victim), twice the sum ("scaled"), its negation ("negated"), or the true
    sum to rank 0 and the sum plus the victim's frame to the others ("split"). The
    victim's frame reaches the other ranks' copies of the attacker through the rendezvous store (the
    real fold sees every frame). Every other round is folded honestly.
    """
    import io

    client = transport.group.client
    store = transport.store
    deposit, wait_round = client.deposit, client.wait_round
    attacked: dict[int, tuple[torch.Tensor, str]] = {}

    def spying_deposit(
        tensors: Sequence[torch.Tensor], *, weight: float = 1.0, fold: str | None = None
    ) -> int:
        number = deposit(tensors, weight=weight, fold=fold)
        (tensor,) = tensors
        if tensor.ndim == 4 and not attacked and (fold or "").startswith("modular:"):
            attacked[number] = (tensor, str(fold))
            if transport.rank == victim:
                buffer = io.BytesIO()
                torch.save(tensor.clone(), buffer)
                store.set("malicious-fold/victim", buffer.getvalue())
        return number

    def lying_wait_round(round_number: int, timeout: float | None = None) -> tuple[torch.Tensor, ...]:
        honest = wait_round(round_number, timeout)
        if round_number not in attacked:
            return honest
        store.wait(["malicious-fold/victim"])
        victims = torch.load(io.BytesIO(store.get("malicious-fold/victim")))
        moduli = torch.tensor([int(q) for q in attacked[round_number][1].removeprefix("modular:").split(",")])
        print(f"rank {transport.rank}: the fold answers round {round_number} with a {attack} sum", flush=True)
        q = moduli.reshape(-1, 1)
        if attack == "substitute":
            return (victims,)
        if attack == "scaled":
            return (torch.remainder(2 * honest[0], q),)
        if attack == "negated":
            return (torch.remainder(-honest[0], q),)
        if attack == "split":  # rank 0 the true sum, every other rank the sum plus the victim's frame
            return honest if transport.rank == 0 else (torch.remainder(honest[0] + victims, q),)
        return (torch.remainder(honest[0] - victims, q),)

    client.deposit = spying_deposit  # type: ignore[method-assign]
    client.wait_round = lying_wait_round  # type: ignore[method-assign]

    from fhelium.multiparty.distributed import ThresholdSession

    decrypt = ThresholdSession.decrypt

    def watched_decrypt(self: ThresholdSession, *args: object, **options: object) -> torch.Tensor:
        # the old relay road published a decryption share for whatever the fold returned: say so if
        # anything still does
        print(f"rank {transport.rank}: ThresholdSession.decrypt called", flush=True)
        return decrypt(self, *args, **options)  # type: ignore[arg-type]

    ThresholdSession.decrypt = watched_decrypt  # type: ignore[method-assign]


# t-out-of-N faults: the rank leaves when the workload records this (before contributing: its update is
# made, nothing sent; mid-decryption: its decryption share is made, not yet summed)
LEAVING = {"leave-early": "update", "leave-mid": "decryption_share"}


def main() -> int:
    faults = argparse.ArgumentParser(add_help=False)
    faults.add_argument(
        "--fault", choices=("values", "scale", "foreign-key", "leave", "leave-early", "leave-mid")
    )
    faults.add_argument("--fault-rank", type=int, default=1)
    faults.add_argument("--audit-dir")
    faults.add_argument("--keys", choices=("single", "threshold"), default="single")
    faults.add_argument(
        "--malicious-fold", choices=("substitute", "subset", "scaled", "negated", "split")
    )
    faults.add_argument("--leave-by", choices=("exit", "kill"), default="exit")
    fault_args, rest = faults.parse_known_args()
    args = cli.parse_arguments(rest)
    torch.set_num_threads(1)
    transport = cli.open_transport(cli.choose_transport(args.transport))
    rank = transport.rank
    if fault_args.malicious_fold:
        assert isinstance(transport, RelayTransport), "--malicious-fold plays the relay road's fold"
        play_malicious_fold(transport, fault_args.malicious_fold, victim=fault_args.fault_rank)
    faulty = fault_args.fault if rank == fault_args.fault_rank else None
    values = args.values + 1 if faulty == "values" else args.values
    parameters = aggregation.AGGREGATION_PARAMETERS
    if faulty == "scale":
        parameters = parameters.model_copy(update={"scale_bits": parameters.scale_bits - 2})

    def own_key(public: PublicKey, engine: CkksEngine) -> PublicKey:
        return engine.generate_public_key(engine.generate_secret_key())

    def leave() -> None:
        print(f"rank {rank}: leaving before the all-reduce", flush=True)
        os._exit(0)

    def audit(name: str, tensor: torch.Tensor) -> None:
        torch.save(tensor.clone(), Path(fault_args.audit_dir) / f"rank{rank}-{name}.pt")

    def leave_now() -> None:  # a t-out-of-N leaver: a clean exit, or killed as by the OOM killer
        if fault_args.leave_by == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)

    def threshold_audit(name: str, tensor: torch.Tensor) -> None:
        if fault_args.audit_dir:
            audit(name, tensor)
        if (faulty, name) in LEAVING.items():
            print(f"rank {rank}: leaving at {name!r} ({faulty})", flush=True)
            leave_now()

    if fault_args.keys == "threshold":
        def leave_before_share() -> None:
            print(f"rank {rank}: leaving after encrypting, before its decryption share", flush=True)
            leave_now()

        try:
            outcome = threshold.aggregate_mean_threshold(
                transport,
                values=values,
                seed=args.seed,
                bound=args.bound,
                lower=args.lower,
                share_timeout_s=args.share_timeout,
                say=lambda message: print(f"rank {rank}: {message}", flush=True),
                before_decrypt=leave_before_share if faulty == "leave" else None,
                audit=threshold_audit if fault_args.audit_dir or faulty in LEAVING else None,
                threshold=args.threshold,
            )
        except AggregationError as error:
            print(f"rank {rank}: FAILED: {type(error).__name__}: {error}", flush=True)
            return 1
        print(f"rank {rank}: {cli.report(outcome, transport.name, 'threshold')}", flush=True)
        return 0 if outcome.ok else 1

    try:
        outcome = aggregation.aggregate_mean(
            transport,
            values=values,
            seed=args.seed,
            bound=args.bound,
            lower=args.lower,
            parameters=parameters,
            say=lambda message: print(f"rank {rank}: {message}", flush=True),
            public_key_hook=own_key if faulty == "foreign-key" else None,
            before_reduce=leave if faulty == "leave" else None,
            audit=audit if fault_args.audit_dir else None,
        )
    except AggregationError as error:
        print(f"rank {rank}: FAILED: {type(error).__name__}: {error}", flush=True)
        return 1
    print(f"rank {rank}: {cli.report(outcome, transport.name)}", flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
