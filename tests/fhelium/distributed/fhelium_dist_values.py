"""Small deterministic fhelium values shared by the single-process tests and the rank scenarios."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fhelium.core import (
    Ciphertext,
    CompressedPlaintext,
    ConjugationKey,
    KeySwitchKey,
    Plaintext,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
)
from fhelium.engine import CkksEngine, CkksParameters

# NTT-friendly sizes do not matter for transport; these primes only bound the residues.
TEST_MODULI = (
    1_152_921_504_606_584_833,
    1_099_511_922_689,
    1_099_512_004_609,
    1_099_512_037_377,
    268_369_921,
)


def residues(shape: tuple[int, ...], prime_ids: tuple[int, ...], seed: int) -> torch.Tensor:
    """Uniform residues in ``[0, q)`` per limb row (limb axis = -2), int64."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index, prime_id in enumerate(prime_ids):
        row_shape = (*shape[:-2], 1, shape[-1])
        modulus = TEST_MODULI[prime_id % len(TEST_MODULI)]
        rows.append(torch.randint(0, modulus, row_shape, generator=generator, dtype=torch.int64))
        del index
    return torch.cat(rows, dim=-2)


def ciphertext(
    seed: int = 0,
    *,
    batch: tuple[int, ...] = (),
    prime_ids: tuple[int, ...] = (1, 2, 3),
    ring: int = 16,
    depth: int = 1,
    scale: float = 2.0**40,
) -> Ciphertext:
    data = residues((2, *batch, len(prime_ids), ring), prime_ids, seed)
    return Ciphertext(data, depth, scale, prime_ids)


def plaintext_slots(seed: int = 0) -> Plaintext:
    generator = torch.Generator().manual_seed(seed)
    return Plaintext(torch.randn(2, 8, generator=generator, dtype=torch.float64), 0, 2.0**30)


def plaintext_rns(seed: int = 0) -> Plaintext:
    data = residues((3, 16), (0, 1, 2), seed)
    return Plaintext(None, 0, 2.0**40, data, "rns", "ntt", "Q", "montgomery", (0, 1, 2))


def compressed_sparse(seed: int = 0) -> CompressedPlaintext:
    data = residues((2, 2, 4), (1, 2), seed)
    implicit = residues((2, 2, 1), (1, 2), seed + 1)[..., 0]
    return CompressedPlaintext(
        data, 16, "strided_sparse", 1, 2.0**40, (1, 2), "coefficient", "Q", "montgomery", implicit
    )


def keys(seed: int = 0) -> list[object]:
    ids = (0, 1, 2, 3)
    return [
        PublicKey(residues((2, 4, 16), ids, seed), ids, "ntt", "Q", "montgomery"),
        KeySwitchKey(residues((2, 2, 4, 16), ids, seed + 1), ids),
        RotationKey(residues((2, 2, 4, 16), ids, seed + 2), ids, rotation_step=3),
        RelinearizationKey(residues((2, 2, 4, 16), ids, seed + 3), ids),
        ConjugationKey(residues((2, 2, 4, 16), ids, seed + 4), ids),
    ]


def secret_key(seed: int = 0) -> SecretKey:
    return SecretKey(residues((4, 16), (0, 1, 2, 3), seed), (0, 1, 2, 3))


def same_value(left: object, right: object) -> bool:
    """Exact type, metadata and bit-identical tensors (the transport contract)."""
    from fhelium.serialization.value import ValueEnvelope

    if type(left) is not type(right):
        return False
    a, b = ValueEnvelope.from_value(left), ValueEnvelope.from_value(right)
    if (a.value_type, a.metadata, list(a.tensors)) != (b.value_type, b.metadata, list(b.tensors)):
        return False
    return all(
        a.tensors[n].dtype == b.tensors[n].dtype and torch.equal(a.tensors[n], b.tensors[n])
        for n in a.tensors
    )


def toy_engine(seed: int = 7, device: torch.device | str = "cpu", log_ring_degree: int = 4) -> CkksEngine:
    """A real engine on a 16-coefficient ring (by default) with five primes (ids 0..4); not secure."""
    parameters = CkksParameters(
        log_ring_degree=log_ring_degree,
        scale_bits=30,
        scale_prime_bits=(30, 30, 30),
        base_prime_bits=40,
        special_prime_bits=40,
        enforce_security=False,
    )
    return CkksEngine(parameters, device=device, rng_seed=seed)


def engine_residues(
    engine: CkksEngine, shape: tuple[int, ...], prime_ids: Sequence[int], seed: int
) -> torch.Tensor:
    """Uniform residues in ``[0, q)`` of the engine's primes (limb axis = -2)."""
    generator = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(0, q, (*shape[:-2], 1, shape[-1]), generator=generator, dtype=torch.int64)
        for q in engine.moduli_for(prime_ids)
    ]
    return torch.cat(rows, dim=-2)
