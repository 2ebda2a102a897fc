"""Federated averaging with no key holder: a model's gradients averaged encrypted, every rank decrypts.

    fdl run examples/threshold_aggregation.py                         # 2 CPU ranks, relay road
    fdl run --ranks 3 examples/threshold_aggregation.py -- --steps 5
    fdl run examples/threshold_aggregation.py -- --transport process-group
    fdl run --ranks 3 examples/threshold_aggregation.py -- --keys threshold --threshold 2 \
        --steps 2 --kill-after-encrypting 2 --share-timeout 10   # t-out-of-N: rank 2 is SIGKILLed

Every rank trains the same small linear model on its own data. Each step the ranks average their
gradients under threshold CKKS (fhelium.multiparty.ThresholdSession): the public key is built from
every rank's key share, each rank encrypts its gradient, the ciphertexts are summed, and the sum is
decrypted on every rank from every rank's decryption share. On the relay road the shares and
ciphertext residues travel through flodld's relays and rendezvous store
(`flodld_fhelium.relay.RelayShareChannel`: the relays and the controller add residues and never hold
a key); on the process group through torch collectives. No rank, relay or controller sees another
rank's gradient. With `--threshold t` the keys are t-out-of-N (each rank's Shamir points are dealt
to the others sealed to their X25519 dealing keys) and any t ranks still there decrypt: a rank that
vanishes before contributing is left out of the mean, one that vanishes after contributing still counts,
and every rank prints whose inputs the mean covers. As a demo's oracle, each rank recomputes the
plaintext mean from the covered ranks' (seeded) data and checks the decrypted one against it. Exit
code 0 when every step is within the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()  # agent and relay roles run and exit here, before torch

import torch  # noqa: E402

import flodld  # noqa: E402
from fhelium.multiparty import THRESHOLD_AGGREGATION, MultipartyError  # noqa: E402
from fhelium.multiparty.dealing import DealingIdentity  # noqa: E402
from fhelium.multiparty.distributed import ThresholdSession  # noqa: E402
from flodld_fhelium.cli import choose_transport, open_transport  # noqa: E402
from flodld_fhelium.errors import AggregationError  # noqa: E402
from flodld_fhelium.threshold import share_channel  # noqa: E402

FEATURES = 64
BOUND = 1e-5


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s data at `step` (seeded, so every rank can recompute every rank's gradient)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(32, FEATURES, generator=generator, dtype=torch.float64)
    return inputs, inputs.sum(dim=1, keepdim=True) / FEATURES


def gradient(model: torch.nn.Linear, rank: int, step: int) -> torch.Tensor:
    """The flattened, clipped gradient of the squared error on this rank's batch."""
    model.zero_grad()
    inputs, targets = batch(rank, step)
    torch.autograd.backward(torch.nn.functional.mse_loss(model(inputs), targets))
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return flat.clamp(-1.0, 1.0)  # bounded: the sum over the world must stay inside the slots' headroom


def load_pins(path: str) -> dict[int, str]:
    """The operator's pin file: a JSON object mapping each rank to the SHA-256 hex of its dealing key."""
    with open(path, encoding="utf-8") as file:
        raw = json.loads(file.read(64 * 1024))
    if not isinstance(raw, dict) or not all(
        isinstance(v, str) and len(v) == 64 and str(k).isdigit() for k, v in raw.items()
    ):
        raise MultipartyError(f"{path}: expected a JSON object {{\"rank\": \"64 hex characters\"}}")
    return {int(k): v for k, v in raw.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--transport", choices=("auto", "relay", "process-group"), default="auto")
    parser.add_argument("--share-timeout", type=float, default=120.0, help="seconds to wait for a share")
    parser.add_argument(
        "--keys", choices=("threshold",), default="threshold", help="no key holder (the only mode)"
    )
    parser.add_argument(
        "--threshold", type=int, default=None, metavar="T",
        help="t-out-of-N keys: any T ranks decrypt (default: N-out-of-N, every rank needed)",
    )
    parser.add_argument(
        "--dealing-key", metavar="FILE",
        help="t-out-of-N: this rank's long-term X25519 dealing key "
        "(made by: python -m fhelium.multiparty.dealing new FILE)",
    )
    parser.add_argument(
        "--dealing-pins", metavar="FILE",
        help='t-out-of-N: JSON {"rank": "sha256 hex of its dealing key"}; any other key is refused',
    )
    parser.add_argument(
        "--kill-after-encrypting", type=int, default=None, metavar="R",
        help="demo: rank R SIGKILLs itself in the first step once its input is in the checked sum",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = choose_transport(args.transport)
    try:
        transport = open_transport(name)
        rank, world = transport.rank, transport.world_size
        channel = share_channel(transport, session="threshold-example", timeout_s=args.share_timeout)
        session = ThresholdSession(
            channel, THRESHOLD_AGGREGATION, session="threshold-example", threshold=args.threshold,
            dealing_identity=DealingIdentity.load(args.dealing_key) if args.dealing_key else None,
            dealing_pins=load_pins(args.dealing_pins) if args.dealing_pins else None,
        )
        session.generate_public_key()  # every rank's key share; nobody holds the secret key
        if args.threshold is not None:
            print(
                f"rank {rank}/{world}: t-out-of-N keys, threshold {args.threshold}; dealing transcript "
                f"{str(session.dealing_fingerprint)[:16]}",
                flush=True,
            )
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)  # the same start on every rank
        worst = 0.0
        for step in range(args.steps):
            mine = gradient(model, rank, step)

            def leave(step: int = step) -> None:
                if step == 0 and rank == args.kill_after_encrypting:
                    print(f"rank {rank}/{world}: encrypted and contributed; killed (SIGKILL) now", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            total = session.aggregate(mine.reshape(1, -1), before_contribution=leave)  # [1, slots]
            covered = session.contributors  # whose gradients the sum holds
            mean = total.reshape(-1)[: mine.numel()] / len(covered)
            truth = torch.stack([gradient(model, other, step) for other in covered]).mean(dim=0)
            worst = max(worst, float((mean - truth).abs().max()))
            with torch.no_grad():
                offset = 0
                for parameter in model.parameters():
                    parameter.sub_(0.1 * mean[offset : offset + parameter.numel()].view_as(parameter))
                    offset += parameter.numel()
            print(
                f"rank {rank}/{world}: step {step}: encrypted mean of {mine.numel()} gradients over the "
                f"inputs of rank(s) {covered} (mean[:3] = {[round(float(v), 6) for v in mean[:3]]})",
                flush=True,
            )
    except (AggregationError, MultipartyError) as error:
        print(f"threshold_aggregation: FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    verdict = "PASS" if worst <= BOUND else "FAIL"
    print(f"rank {rank}/{world}: threshold aggregation {verdict}: max error {worst:.2e} ({name})", flush=True)
    return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
