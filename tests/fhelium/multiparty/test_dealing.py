"""Sealing Shamir points to a receiver's X25519 key (in process): only the receiver opens them, bound to the
session, the key generation, the parties and the threshold; pins refuse substituted keys; the t-of-N noise.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fhelium.engine import modular as mod
from fhelium.multiparty import THRESHOLD_AGGREGATION, ThresholdParty, expected_max_mean_error
from fhelium.multiparty.dealing import (
    DealingError,
    DealingIdentity,
    Recipient,
    check_public_keys,
    key_fingerprint,
    open_point,
    seal_points,
)
from fhelium.multiparty.shamir import activate, deal, receive

REPO = Path(__file__).resolve().parents[3]


def _world(parties: int) -> tuple[list[ThresholdParty], bytes, object]:
    members = [ThresholdParty(rank, parties, session="d", rng_seed=500 + rank) for rank in range(parties)]
    seed = members[0].combine_seed([m.commit_seed() for m in members], [m.reveal_seed() for m in members])
    public = members[0].combine_public_key([m.key_share(seed) for m in members], seed)
    return members, seed, public


def test_only_the_receiver_opens_its_point_and_any_change_of_binding_is_refused() -> None:
    torch.set_num_threads(1)
    members, seed, _ = _world(3)
    identities = [DealingIdentity.generate() for _ in members]
    keys = [identity.public_bytes for identity in identities]
    engine = members[0].engine
    points = deal(members[0], 2)
    record = seal_points(identities[0], points, keys, dealer=0, session="d", seed=seed, threshold=2)
    common = {"session": "d", "seed": seed, "threshold": 2, "moduli": engine.moduli,
              "ring_degree": engine.ring_degree}
    opened = open_point(Recipient(identities[1], 1, keys), record, dealer=0, **common)  # type: ignore[arg-type]
    assert torch.equal(opened, points[1].cpu())
    assert points[1].contiguous().numpy().tobytes()[:64] not in record
    refusals: dict[str, tuple[DealingIdentity, dict[str, object]]] = {
        "another rank": (identities[2], {}),
        "a key the transport made": (DealingIdentity.generate(), {}),
        "another session": (identities[1], {"session": "other"}),
        "another key generation": (identities[1], {"seed": bytes(32)}),
        "another threshold": (identities[1], {"threshold": 3}),
    }
    for name, (identity, change) in refusals.items():
        arguments = {**common, **change}
        with pytest.raises(DealingError, match="rank 0 dealt to rank 1 fails authentication"):
            open_point(Recipient(identity, 1, keys), record, dealer=0, **arguments)  # type: ignore[arg-type]
        del name
    tampered = bytearray(record)
    tampered[-1] ^= 1
    with pytest.raises(DealingError, match="fails authentication"):
        open_point(Recipient(identities[2], 2, keys), bytes(tampered), dealer=0, **common)  # type: ignore[arg-type]
    with pytest.raises(DealingError, match="expected"):
        open_point(Recipient(identities[1], 1, keys), record[:-1], dealer=0, **common)  # type: ignore[arg-type]


def test_pins_refuse_a_substituted_dealing_key_and_duplicates_are_refused(tmp_path: Path) -> None:
    identities = [DealingIdentity.generate() for _ in range(3)]
    keys = [identity.public_bytes for identity in identities]
    pins = {rank: identity.fingerprint for rank, identity in enumerate(identities)}
    check_public_keys(keys, pins)
    substituted = [keys[0], DealingIdentity.generate().public_bytes, keys[2]]
    with pytest.raises(DealingError, match=r"rank\(s\) \[1\] published a dealing key whose SHA-256 is not"):
        check_public_keys(substituted, pins)
    with pytest.raises(DealingError, match="ranks 0 and 2 published the same dealing key"):
        check_public_keys([keys[0], keys[1], keys[0]])
    # a long-term key an operator keeps (mode 0600) and its pin, printed by the module's command
    path = tmp_path / "dealing.key"
    made = subprocess.run([sys.executable, "-m", "fhelium.multiparty.dealing", "new", str(path)],
                          env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True)
    loaded = DealingIdentity.load(path)
    assert made.stdout.strip() == loaded.fingerprint == key_fingerprint(loaded.public_bytes)
    assert path.stat().st_mode & 0o777 == 0o600
    (tmp_path / "bad.key").write_bytes(b"short")
    with pytest.raises(DealingError, match="expected a 32-byte X25519 private key"):
        DealingIdentity.load(tmp_path / "bad.key")


def test_t_of_n_mean_error_stays_within_1e6_and_the_prediction_counts_the_active_floods_only() -> None:
    torch.set_num_threads(1)
    parties, threshold = 5, 3
    members, _, public = _world(parties)
    dealt = [deal(m, threshold) for m in members]
    shamir = [receive(m, {d: dealt[d][m.party] for d in range(parties)}) for m in members]
    updates = [torch.rand(1, 4096, generator=torch.Generator().manual_seed(r), dtype=torch.float64) * 2 - 1
               for r in range(parties)]
    engine = members[0].engine
    total = engine.sum([m.encrypt(u, public) for m, u in zip(members, updates, strict=True)])  # type: ignore[arg-type]
    q = engine._mod(total.prime_ids).q
    truth = sum(updates) / parties
    for active in ((0, 2, 4), (0, 1, 2, 3, 4)):
        summed = None
        for j in active:
            activate(members[j], shamir[j], active, threshold)
            share = members[j].decryption_share(total).data
            summed = share if summed is None else mod.add_mod(summed, share, q)
        assert summed is not None
        mean = members[active[0]].combine_decryption(total, summed).real / parties
        error = float((mean - truth).abs().max())
        predicted = expected_max_mean_error(
            engine.ring_degree, parties, THRESHOLD_AGGREGATION.smudging_sigma,
            THRESHOLD_AGGREGATION.message_scale, 4096, decryptors=len(active),
        )
        assert error <= 1e-6 and predicted <= 1e-6
        assert error <= 3 * predicted, (active, error, predicted)  # the flooding noise dominates
    # the Lagrange coefficients scale the exact Shamir share (flooding added after): |A| floods, not Σ|λ|
    assert math.isclose(
        expected_max_mean_error(8192, 5, 2.0**57, 2.0**88, 2**20, decryptors=3),
        expected_max_mean_error(8192, 5, 2.0**57, 2.0**88, 2**20) * math.sqrt(3 / 5),
    )
