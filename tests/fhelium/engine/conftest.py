from __future__ import annotations

import pytest
import torch

from fhelium.engine import CkksEngine, CkksParameters, KeySet, Preset

ROTATION_STEPS = (1, -2, 5)


@pytest.fixture(scope="session", autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def toy_engine() -> CkksEngine:
    return CkksEngine(Preset.TOY_N1024, rng_seed=1234)


@pytest.fixture(scope="session")
def toy_keys(toy_engine: CkksEngine) -> KeySet:
    return toy_engine.generate_keys(rotation_steps=ROTATION_STEPS, conjugation=True)


TINY_PARAMETERS = CkksParameters(
    log_ring_degree=4,
    scale_bits=20,
    scale_prime_bits=(30, 30),
    base_prime_bits=35,
    special_prime_bits=40,
    enforce_security=False,
)


@pytest.fixture(scope="session")
def tiny_engine() -> CkksEngine:
    """N = 16: small enough for O(N²) big-integer reference products."""
    return CkksEngine(TINY_PARAMETERS, rng_seed=99)
