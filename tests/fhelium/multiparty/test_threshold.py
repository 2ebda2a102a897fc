"""fhelium.multiparty in process: several parties, the real engine, no mocks."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Protocol, cast

import pytest
import torch

from fhelium.core import FheliumValueError, PublicKey
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty import (
    THRESHOLD_AGGREGATION,
    DecryptionShare,
    MissingSharesError,
    PublicKeyShare,
    SecretKeyShare,
    SeedCommitment,
    SeedCommitmentError,
    SeedReveal,
    ThresholdParty,
    combine_decryption,
    decode_contributions,
    expected_max_mean_error,
    required_smudging_sigma,
    smudging_noise,
)
from fhelium.multiparty.sumcheck import (
    out_of_range,
    project_checked,
    projection_weights,
)
from fhelium.serialization import inspect_bytes, validate_value_description, value_from_bytes, value_to_bytes


def _world(parties: int, session: str = "test") -> tuple[list[ThresholdParty], bytes, PublicKey]:
    members = [
        ThresholdParty(rank, parties, session=session, rng_seed=1000 + rank) for rank in range(parties)
    ]
    commitments = [member.commit_seed() for member in members]
    reveals = [member.reveal_seed() for member in members]
    seed = members[0].combine_seed(commitments, reveals)
    shares = [member.key_share(seed) for member in members]
    public = members[0].combine_public_key(shares, seed)
    return members, seed, public


class _HasData(Protocol):
    """A value whose payload is one tensor (`hasattr(value, "data")`)."""

    data: torch.Tensor


def _updates(parties: int, rows: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(parties)
    return [torch.rand(rows, 4096, generator=generator, dtype=torch.float64) * 2 - 1 for _ in range(parties)]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_preset_keeps_128_bit_security_and_the_error_bound() -> None:
    params = THRESHOLD_AGGREGATION
    params.check()
    assert params.ckks.total_modulus_bits == 150 <= 218 and params.ckks.enforce_security
    assert params.smudging_sigma >= required_smudging_sigma(params.ckks.ring_degree, params.max_parties, 40)
    for parties in (2, 4):
        estimate = expected_max_mean_error(
            params.ckks.ring_degree, parties, params.smudging_sigma, params.message_scale, 1 << 20
        )
        assert estimate <= 2e-7  # the bound is 1e-6


@pytest.mark.parametrize("parties", [2, 3, 5])
def test_collective_decryption_gives_the_sum(parties: int) -> None:
    members, _, public = _world(parties)
    updates = _updates(parties)
    cts = [member.encrypt(update, public) for member, update in zip(members, updates, strict=True)]
    engine = members[0].engine
    total = engine.sum(cts)
    shares = [member.decryption_share(total) for member in members]
    for member in members:  # anyone with c0 + Σ h_i decodes, every party gets the same sum
        slots = member.combine_decryption(total, shares).real
        error = float((slots - sum(updates)).abs().max())
        assert error < 1e-6 * parties, error


@pytest.mark.parametrize("parties", [2, 3])
def test_any_n_minus_1_decryption_shares_give_noise_not_the_sum(parties: int) -> None:
    members, _, public = _world(parties)
    updates = _updates(parties)
    engine = members[0].engine
    total = engine.sum([m.encrypt(u, public) for m, u in zip(members, updates, strict=True)])
    truth = cast(torch.Tensor, sum(updates))  # a tensor: there is at least one update
    shares = [member.decryption_share(total) for member in members]
    q = engine._mod(total.prime_ids).q
    for left_out in range(parties):
        partial = [share for share in shares if share.party != left_out]
        with pytest.raises(MissingSharesError, match=rf"missing rank\(s\) \[{left_out}\]") as caught:
            combine_decryption(engine, total, partial, parties=parties)
        assert caught.value.missing == [left_out]
        # summing the N-1 shares anyway: what comes out is noise the size of the whole modulus
        summed = partial[0].data.clone()
        for share in partial[1:]:
            summed = torch.remainder(summed + share.data, q)
        slots = combine_decryption(engine, total, summed).real
        error = (slots - truth).abs()
        assert float(error.mean()) > 100.0  # headroom is 2048: uniform garbage, not the sum
        assert abs(float(torch.corrcoef(torch.stack((slots.flatten(), truth.flatten())))[0, 1])) < 0.05


def _fused_contributions(
    parties: int, rows: int = 2
) -> tuple[list[ThresholdParty], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every party's c0_i + s_i·Σc1 + e_i' (the fused protocol of ThresholdSession.aggregate)."""
    members, _, public = _world(parties)
    updates = _updates(parties, rows)
    cts = [member.encrypt(update, public) for member, update in zip(members, updates, strict=True)]
    engine = members[0].engine
    q = engine._mod(cts[0].prime_ids).q
    c1 = cts[0].data[1].clone()
    for ct in cts[1:]:
        c1 = torch.remainder(c1 + ct.data[1], q)
    contributions = [member.decryption_contribution(ct, c1) for member, ct in zip(members, cts, strict=True)]
    return members, contributions, cast(torch.Tensor, sum(updates)), q


@pytest.mark.parametrize("parties", [2, 3, 5])
def test_fused_contributions_c0_plus_share_sum_to_the_sum(parties: int) -> None:
    members, contributions, truth, q = _fused_contributions(parties, rows=11)  # 11: one partial block
    total = contributions[0].clone()
    for contribution in contributions[1:]:
        total = torch.remainder(total + contribution, q)
    engine = members[0].engine
    slots = decode_contributions(engine, total, engine.q_ids_at(0), THRESHOLD_AGGREGATION.message_scale)
    error = float((slots - truth).abs().max())
    assert error < 1e-6 * parties, error


@pytest.mark.parametrize("parties", [2, 3])
def test_any_n_minus_1_fused_contributions_give_noise_not_the_sum(parties: int) -> None:
    members, contributions, truth, q = _fused_contributions(parties)
    engine = members[0].engine
    for left_out in range(parties):
        partial = [c for rank, c in enumerate(contributions) if rank != left_out]
        summed = partial[0].clone()
        for contribution in partial[1:]:
            summed = torch.remainder(summed + contribution, q)
        slots = decode_contributions(engine, summed, engine.q_ids_at(0), THRESHOLD_AGGREGATION.message_scale)
        error = (slots - truth).abs()
        assert float(error.mean()) > 100.0  # the missing c0_j - s_j·c1 term: uniform garbage
        assert abs(float(torch.corrcoef(torch.stack((slots.flatten(), truth.flatten())))[0, 1])) < 0.05


def test_the_fused_contribution_is_c0_plus_the_decryption_share() -> None:
    # c0_i + h_i with the same flooding noise stream: the fused step publishes a function of what the
    # unfused protocol published (c0_i inside the ciphertext sum, h_i as the decryption share).
    members, _, public = _world(2)
    ct = members[0].encrypt(_updates(2)[0], public)
    engine = members[0].engine
    q = engine._mod(ct.prime_ids).q
    twin = ThresholdParty(0, 2, session="test", rng_seed=1000)  # same randomness as members[0]
    twin.secret = members[0].secret
    share = twin.decryption_share(ct, digest=False).data
    fused = members[0].decryption_contribution(ct, ct.data[1])
    assert torch.equal(fused, torch.remainder(ct.data[0] + share, q))


def test_commitment_refuses_a_rank_revealing_a_different_seed() -> None:
    members = [ThresholdParty(rank, 3, session="s") for rank in range(3)]
    commitments = [member.commit_seed() for member in members]
    reveals = [member.reveal_seed() for member in members]
    cheat = SeedReveal(1, 3, "s", bytes(32))
    with pytest.raises(
        SeedCommitmentError, match=r"rank\(s\) \[1\] revealed a seed contribution that does not match"
    ):
        members[0].combine_seed(commitments, [reveals[0], cheat, reveals[2]])
    # copying another rank's commitment and contribution does not cancel it out either
    copied = [commitments[0], SeedCommitment(1, 3, "s", commitments[0].digest), commitments[2]]
    with pytest.raises(SeedCommitmentError, match=r"rank\(s\) \[1\]"):
        members[0].combine_seed(
            copied, [reveals[0], SeedReveal(1, 3, "s", reveals[0].contribution), reveals[2]]
        )
    with pytest.raises(SeedCommitmentError, match=r"rank\(s\) \[2\] missing"):
        members[0].combine_seed(commitments, reveals[:2])
    seed = members[0].combine_seed(commitments, reveals)
    xor = bytes(a ^ b ^ c for a, b, c in zip(*(r.contribution for r in reveals), strict=True))
    assert seed == xor and len(seed) == 32


def test_smudging_noise_has_the_stated_distribution() -> None:
    params = THRESHOLD_AGGREGATION
    sigma = params.smudging_sigma
    count = 1 << 18
    raw = smudging_noise(RandomSource(7, purpose="smudging"), count, params)
    assert raw.dtype == torch.int64
    noise = raw.double()
    assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(count)
    assert abs(float(noise.std()) / sigma - 1) < 0.01
    tail = float((noise.abs() > 2 * sigma).double().mean())
    assert abs(tail - 0.0455) < 0.003  # Gaussian: P(|X| > 2σ) = 4.55%
    # the low bits are smooth too (the 2^shift lattice of the high part is filled by the low part)
    low = torch.remainder(raw, 1 << 10)  # exact integers (a float64 at 2^57 has no low bits)
    counts = torch.bincount(low, minlength=1 << 10).double()
    expected = count / (1 << 10)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 1023 + 6 * math.sqrt(2 * 1023)


def test_decryption_share_noise_is_the_flooding_noise() -> None:
    members, _, public = _world(2)
    member = members[0]
    engine = member.engine
    ct = member.encrypt(torch.zeros(8, 4096, dtype=torch.float64), public)
    share = member.decryption_share(ct)
    ids = ct.prime_ids
    m = engine._mod(ids)
    from fhelium.engine import modular as mod

    assert member.secret is not None
    exact = mod.mul_mod(ct.data[1], member.secret.data[list(ids)], m.q, m.q_inverse)
    noise = engine.ntt.inverse(mod.sub_mod(share.data, exact, m.q), ids)
    centered = engine._reconstruct(noise, ids)  # CRT over both primes: |e| < 2^61 exceeds one 50-bit prime
    assert abs(float(centered.std()) / THRESHOLD_AGGREGATION.smudging_sigma - 1) < 0.02


def test_every_value_round_trips_through_bytes_and_the_secret_share_needs_allow_secret() -> None:
    members, seed, public = _world(2)
    member = members[0]
    engine = member.engine
    ct = member.encrypt(torch.zeros(1, 4096, dtype=torch.float64), public)
    values = [member.commit_seed(), member.reveal_seed(), member.key_share(seed), member.decryption_share(ct)]
    for value in values:
        blob = value_to_bytes(value, engine=engine)
        again = value_from_bytes(blob, engine=engine, expected_type=type(value).__name__)
        assert type(again) is type(value)
        if hasattr(value, "data"):
            assert torch.equal(cast(_HasData, again).data, cast(_HasData, value).data)
    assert member.secret is not None
    with pytest.raises(PermissionError, match="SecretKeyShare"):
        value_to_bytes(member.secret, engine=engine)
    again = value_from_bytes(value_to_bytes(member.secret, engine=engine, allow_secret=True), engine=engine)
    assert isinstance(again, SecretKeyShare) and torch.equal(again.data, member.secret.data)
    assert isinstance(values[2], PublicKeyShare) and isinstance(values[3], DecryptionShare)


def test_share_descriptions_are_validated_before_any_payload() -> None:
    good = {
        "prime_ids": [0, 1],
        "depth": 0,
        "scale": 2.0**88,
        "party": 0,
        "parties": 2,
        "ciphertext_digest_hex": "00" * 32,
    }
    shape = {"data": {"shape": (4, 2, 8192), "dtype": torch.int64}}
    validate_value_description(
        schema_version=2,
        value_type="DecryptionShare",
        metadata=good,
        tensor_names=["data"],
        tensor_metadata=shape,
    )
    bad_cases = [
        ({**good, "party": 2}, shape, "party must be an int in"),
        ({**good, "extra": 1}, shape, "unexpected fields"),
        (good, {"data": {"shape": (4, 3, 8192), "dtype": torch.int64}}, "limb axis has 3 rows"),
        (good, {"data": {"shape": (4, 2, 8192), "dtype": torch.float64}}, "must be int64"),
        (good, {"data": {"shape": (2**30, 2**30, 2, 8192), "dtype": torch.int64}}, "spans over"),
    ]
    for metadata, tensors, message in bad_cases:
        with pytest.raises(FheliumValueError, match=message):
            validate_value_description(
                schema_version=2,
                value_type="DecryptionShare",
                metadata=metadata,
                tensor_names=["data"],
                tensor_metadata=tensors,
            )
    with pytest.raises(FheliumValueError, match="seed_hex"):
        validate_value_description(
            schema_version=2,
            value_type="PublicKeyShare",
            metadata={"prime_ids": [0, 1, 2], "party": 0, "parties": 2, "seed_hex": "zz"},
            tensor_names=["data"],
        )


def test_a_share_loads_in_a_process_that_never_imported_multiparty(tmp_path: Path) -> None:
    member = ThresholdParty(0, 2, session="lazy")
    blob = value_to_bytes(member.commit_seed())
    (tmp_path / "c.fhe").write_bytes(blob)
    assert inspect_bytes(blob)["value_type"] == "SeedCommitment"
    code = (
        "import sys; from fhelium.serialization import load_value; "
        f"v = load_value({str(tmp_path / 'c.fhe')!r}); print(type(v).__name__, v.party, v.parties)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["SeedCommitment", "0", "2"]


def test_the_fast_reductions_give_the_exact_residues() -> None:
    from fhelium.multiparty.encoding import reduce_signed, reduce_sum_

    engine = ThresholdParty(0, 2).engine
    q = torch.tensor(engine.moduli[:2], dtype=torch.int64).reshape(-1, 1)
    q_inverse = 1.0 / q.double()
    generator = torch.Generator().manual_seed(5)
    # signed int64 up to ±2^62 (the flooding noise reaches ±2^60.2, encoded coefficients < 2^62)
    x = torch.randint(-(2**62), 2**62, (3, 1, 4096), generator=generator, dtype=torch.int64)
    x[0, 0, :6] = torch.tensor([0, 1, -1, 2**62 - 1, -(2**62) + 1, int(q[0, 0])])
    assert torch.equal(reduce_signed(x, q, q_inverse), torch.remainder(x, q))
    # sums of `terms` residues, extremes included: 0 and terms·(q − 1)
    for terms in (1, 2, 3, 5, 64):
        parts = [
            torch.remainder(torch.randint(0, 2**62, (11, 2, 64), generator=generator), q)
            for _ in range(terms)
        ]
        total = torch.stack(parts).sum(0)
        total[0, :, 0], total[0, :, 1] = 0, terms * (q[:, 0] - 1)
        expected = torch.remainder(total, q)
        assert torch.equal(reduce_sum_(total.clone(), q, terms), expected)


@pytest.mark.parametrize(
    "rows", [None, 1, 11]
)  # an unbatched ciphertext, one row, rows not a multiple of the block
def test_blocked_decryption_share_and_combine_fit_any_batch(rows: int | None) -> None:
    members, _, public = _world(2)
    generator = torch.Generator().manual_seed(3)
    shape = (4096,) if rows is None else (rows, 4096)
    updates = [torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1 for _ in members]
    engine = members[0].engine
    total = engine.sum([m.encrypt(u, public) for m, u in zip(members, updates, strict=True)])
    shares = [member.decryption_share(total) for member in members]
    assert shares[0].data.shape == total.data.shape[1:]
    slots = combine_decryption(engine, total, shares).real
    assert float((slots.reshape(-1) - cast(torch.Tensor, sum(updates)).reshape(-1)).abs().max()) < 1e-6


@pytest.mark.parametrize("level", ["torch", "auto"])
def test_encrypt_values_is_the_encryption_of_encode_values_bit_for_bit(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """encrypt_values takes the message's residues inside ModDown (encrypt_integers); from the same
    draws it gives the ciphertext engine.encrypt(encode_values(...)) gives, natively and in torch.
    """
    from fhelium.engine import CkksEngine
    from fhelium.multiparty import encode_values, encrypt_values

    monkeypatch.setenv("FHELIUM_NATIVE_LEVEL", level)
    generator = torch.Generator().manual_seed(11)
    values = torch.rand(19, 4096, generator=generator, dtype=torch.float64) * 2 - 1
    values[0, :3] = torch.tensor([1e6, -1e6, 0.0])  # large coefficients: residues of |x| near 2^62
    ciphertexts = []
    for fused in (False, True):
        engine = CkksEngine(THRESHOLD_AGGREGATION.ckks, rng_seed=9)
        public = engine.generate_public_key(engine.generate_secret_key())
        if fused:
            ciphertexts.append(encrypt_values(engine, values, public, THRESHOLD_AGGREGATION))
        else:
            ciphertexts.append(engine.encrypt(encode_values(engine, values, THRESHOLD_AGGREGATION), public))
    plain, fused_ct = ciphertexts
    assert torch.equal(fused_ct.data, plain.data)
    assert fused_ct.scale == plain.scale == THRESHOLD_AGGREGATION.message_scale
    assert fused_ct.prime_ids == plain.prime_ids


@pytest.mark.parametrize("level", ["torch", "auto"])
@pytest.mark.parametrize("rows", [1, 8, 19])
def test_encrypt_flooded_is_flooded_c0_of_the_encryption_bit_for_bit(
    level: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused protocol's encryption carries the flooding noise in c0 (added before ModDown's
    forward NTT): the same bits as encrypt, then flooded_c0, from the same draws.
    """
    monkeypatch.setenv("FHELIUM_NATIVE_LEVEL", level)
    _, _, public = _world(2)
    values = torch.rand(rows, 4096, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
    outputs = []
    for flooded_in_encryption in (False, True):
        party = ThresholdParty(0, 2, rng_seed=77)
        if flooded_in_encryption:
            ct = party.encrypt_flooded(values, public)
            outputs.append((ct.data[0], ct.data[1], ct.scale, ct.prime_ids))
        else:
            ct = party.encrypt(values, public)
            c0 = party.flooded_c0(ct.data[0], ct.prime_ids)
            outputs.append((c0, ct.data[1], ct.scale, ct.prime_ids))
    (c0, c1, scale, ids), (flooded_c0, flooded_c1, flooded_scale, flooded_ids) = outputs
    assert torch.equal(flooded_c0, c0) and torch.equal(flooded_c1, c1)
    assert (flooded_scale, flooded_ids) == (scale, ids)
    # and the noise is there: c0 differs from the plain encryption's by the flooding noise
    plain = ThresholdParty(0, 2, rng_seed=77).encrypt(values, public)
    assert not torch.equal(plain.data[0], flooded_c0) and torch.equal(plain.data[1], flooded_c1)


def test_a_party_refuses_decryption_shares_past_its_flooding_budget_and_a_new_key_share_resets_it() -> None:
    import dataclasses

    from fhelium.multiparty import FloodingBudgetError

    small = dataclasses.replace(THRESHOLD_AGGREGATION, decryption_row_budget=5)
    members = [ThresholdParty(rank, 2, small, session="budget", rng_seed=70 + rank) for rank in range(2)]
    commitments = [member.commit_seed() for member in members]
    reveals = [member.reveal_seed() for member in members]
    seed = members[0].combine_seed(commitments, reveals)
    public = members[0].combine_public_key([member.key_share(seed) for member in members], seed)
    member = members[0]
    three = member.encrypt(torch.zeros(3, 4096, dtype=torch.float64), public)
    member.decryption_share(three)  # 3 of 5 rows
    two = member.encrypt(torch.zeros(2, 4096, dtype=torch.float64), public)
    member.decryption_contribution(two, two.data[1])  # 5 of 5: exactly the budget
    with pytest.raises(FloodingBudgetError) as refused:
        member.decryption_share(member.encrypt(torch.zeros(1, 4096, dtype=torch.float64), public))
    message = str(refused.value)
    assert "flooding budget of 5 rows (5 spent" in message and "2^-40" in message
    assert "Rotate the keys" in message and "generate_public_key again" in message
    assert member.decrypted_rows == 5  # the refused share was not counted (nor published)
    member.key_share(seed)  # a fresh key share has its whole budget
    member.decryption_share(three)
    assert member.decrypted_rows == 3


def test_the_default_flooding_budget_holds_a_thousand_million_value_aggregations() -> None:
    # 1M values are 256 rows of 4096 slots: 2^20 rows are 4096 such aggregations per key, and the
    # statistical distance they spend is at most 2^20 · 2^-40 = 2^-20.
    assert THRESHOLD_AGGREGATION.decryption_row_budget == 2**20
    assert THRESHOLD_AGGREGATION.decryption_row_budget // 256 == 4096


@pytest.mark.parametrize("shape", [(3, 2, 8192), (2, 8192), (70, 2, 1024), (37, 2, 16)])
def test_the_range_check_refuses_a_residue_at_or_above_its_own_limbs_prime_in_any_row(
    shape: tuple[int, ...],
) -> None:
    """The range check of a sum refuses a residue at or above its own limb's prime, or negative, in any
    row, while a residue between the smaller prime and the larger one in the larger prime's limb passes;
    the check the sum checks fuse into their projection (``project_checked``) says the same.
    """
    q = torch.tensor([[1125899905744897], [1125899906629633]], dtype=torch.int64)
    summed = torch.randint(0, 1 << 49, shape, dtype=torch.int64)
    weights = projection_weights(b"\x03" * 32, q, summed.reshape(-1, *shape[-2:]).size(0))
    assert out_of_range(summed, q) is False
    assert project_checked(summed, weights, q, 1.0 / q.double())[1] is False
    small, large = int(q[0]), int(q[1])
    for value, limb, bad in [
        (-1, 0, True),
        (small, 0, True),
        (small - 1, 0, False),
        (small, 1, False),
        (large - 1, 1, False),
        (large, 1, True),
        (large - 1, 0, True),
    ]:
        for row in (0, -1):
            changed = summed.clone()
            changed.view(-1, *shape[-2:])[row, limb, 5] = value
            assert out_of_range(changed, q) is bad
            assert project_checked(changed, weights, q, 1.0 / q.double())[1] is bad


def test_the_names_split_off_distributed_stay_importable_from_it_as_the_same_objects() -> None:
    from fhelium.multiparty import channel, distributed, keygen, sumcheck

    homes = {
        channel: ["DEFAULT_TIMEOUT_S", "EXCHANGES", "MAX_RECORD_BYTES", "MemberLostError",
                  "ProcessGroupChannel", "ShareChannel", "gather_from_store", "missing_error"],
        keygen: ["MAX_KEY_SHARE_BYTES", "key_fingerprint", "key_share_digest"],
        sumcheck: ["DIGEST_BYTES", "SUM_CHECK_DOMAIN", "SumCheckError", "out_of_range",
                   "project", "projection_weights"],
    }
    for module, names in homes.items():
        for name in names:
            assert name in distributed.__all__, name
            assert getattr(distributed, name) is getattr(module, name), name


def test_the_names_split_off_protocol_stay_importable_from_it_as_the_same_objects() -> None:
    from fhelium.multiparty import encoding, errors, protocol

    for module in (encoding, errors):
        for name in module.__all__:
            assert name in protocol.__all__, name
            assert getattr(protocol, name) is getattr(module, name), name
