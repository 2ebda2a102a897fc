"""The workload's refusals, without processes: descriptors, key fingerprints, headroom, lowered relay form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fhelium.engine import CkksEngine
from flodld_fhelium import aggregation, errors
from flodld_fhelium.transport import Transport


@pytest.fixture(scope="module")
def engine() -> CkksEngine:
    return CkksEngine(aggregation.AGGREGATION_PARAMETERS, rng_seed=3)


def test_descriptors_that_match_pass_and_a_differing_rank_is_named_with_both_values(
    engine: CkksEngine,
) -> None:
    reference = aggregation.descriptor(engine, values=10, transport="relay", program="p")
    aggregation.check_descriptors([reference, dict(reference)])
    other = {**reference, "values": 11}
    with pytest.raises(errors.ParameterMismatchError, match=r"rank 2: values=11 \(key holder: 10\)"):
        aggregation.check_descriptors([reference, reference, other])


def test_a_rank_with_another_public_key_is_refused(engine: CkksEngine) -> None:
    secret = engine.generate_secret_key()
    mine = aggregation.key_fingerprint(engine.generate_public_key(secret))
    theirs = aggregation.key_fingerprint(engine.generate_public_key(engine.generate_secret_key()))
    aggregation.check_key_fingerprints([mine, mine])
    with pytest.raises(errors.KeyMismatchError, match=r"rank\(s\) \[1\] would encrypt"):
        aggregation.check_key_fingerprints([mine, theirs, mine])


def test_updates_that_could_wrap_the_modulus_are_refused_before_encryption(engine: CkksEngine) -> None:
    public = engine.generate_public_key(engine.generate_secret_key())
    limit = aggregation.headroom(engine)
    assert 200 < limit < 300  # 2^49 / 2^41: the sum of the world's values per slot
    update = torch.full((8,), limit / 4)
    aggregation.encrypt_update(engine, update, public, world_size=3)
    with pytest.raises(errors.AggregationError, match="clip them"):
        aggregation.encrypt_update(engine, update, public, world_size=4)


def test_the_sum_of_encrypted_updates_decrypts_to_the_mean_within_the_bound(engine: CkksEngine) -> None:
    secret = engine.generate_secret_key()
    public = engine.generate_public_key(secret)
    count, world = 5000, 3  # two ciphertext rows, the second one partly padding
    parts = [
        aggregation.encrypt_update(engine, aggregation.make_update(rank, count, 1), public)
        for rank in range(world)
    ]
    total = engine.sum(parts)
    mean = aggregation.decrypt_mean(engine, total, secret, count, world)
    error = float((mean - aggregation.expected_mean(world, count, 1)).abs().max())
    assert error < aggregation.DEFAULT_ERROR_BOUND / 100


def test_the_lowered_form_is_refused_on_the_relay_path_with_the_reason(engine: CkksEngine) -> None:
    with pytest.raises(errors.AggregationError, match="--lower needs the process-group transport"):
        relay: Transport = SimpleNamespace(name="relay")
        aggregation.link_program(relay, engine, lower=True)
