"""Key generation: secret, public, relinearization, rotation and conjugation keys of a ``CkksEngine``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium.core import (
    ConjugationKey,
    ParameterMismatchError,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
    canonical_rotation_step,
)
from fhelium.engine.keyset import KeySet
from fhelium.engine.operations import EngineOperations
from fhelium.engine.parameters import ERROR_STANDARD_DEVIATION


def check_secret(engine: EngineOperations, secret: object) -> SecretKey:
    if not isinstance(secret, SecretKey) or secret.prime_ids != tuple(range(len(engine.moduli))):
        raise ParameterMismatchError(
            "expected a SecretKey from this engine's generate_secret_key (all QP primes)"
        )
    return secret


def error_ntt(engine: EngineOperations, shape: Sequence[int], prime_ids: Sequence[int]) -> torch.Tensor:
    e = engine.random.stream("error").gaussian((*shape, engine.ring_degree), ERROR_STANDARD_DEVIATION)
    return engine._small_ntt(e.to(engine.device), prime_ids)


def generate_secret_key(engine: EngineOperations) -> SecretKey:
    ids = tuple(range(len(engine.moduli)))
    s = engine.random.stream("secret").ternary((engine.ring_degree,)).to(engine.device)
    return SecretKey(engine._small_ntt(s, ids), ids)


def generate_public_key(engine: EngineOperations, secret: SecretKey) -> PublicKey:
    """(−a·s + e, a) over Q and P: encrypting in QP and dividing by P (as SEAL does) shrinks the
    fresh-encryption noise from ‖e·u + e1·s‖ to the rounding error of that division.
    """
    engine._check_secret(secret)
    ids = secret.prime_ids
    m = engine._mod(ids)
    a = engine.random.stream("uniform").uniform_below(m.q.cpu(), (len(ids), engine.ring_degree))
    a = a.to(engine.device)
    e = engine._error_ntt((), ids)
    k0 = mod.sub_mod(e, mod.mul_mod(a, secret.data, m.q, m.q_inverse), m.q)
    return PublicKey(torch.stack((k0, a)), ids, modulus_basis="QP")


def key_switch_key_data(engine: EngineOperations, secret: SecretKey, source: torch.Tensor) -> torch.Tensor:
    """Digits j < q_count: (−a_j·s + e_j + [row j]·P·source, a_j) over all QP primes, NTT."""
    ids = tuple(range(len(engine.moduli)))
    m = engine._mod(ids)
    digits = engine.q_count
    a = engine.random.stream("uniform").uniform_below(m.q.cpu(), (digits, len(ids), engine.ring_degree))
    a = a.to(engine.device)
    e = engine._error_ntt((digits,), ids)
    k0 = mod.sub_mod(e, mod.mul_mod(a, secret.data, m.q, m.q_inverse), m.q)
    special = engine.moduli[engine.special_prime_id]
    for j in range(digits):
        q_j = engine.moduli[j]
        factor = torch.full_like(source[j], special % q_j)
        gadget = mod.mul_mod(source[j], factor, m.q[j], m.q_inverse[j])
        k0[j, j] = mod.add_mod(k0[j, j], gadget, m.q[j])
    return torch.stack((k0, a), dim=1)


def generate_relinearization_key(engine: EngineOperations, secret: SecretKey) -> RelinearizationKey:
    engine._check_secret(secret)
    m = engine._mod(secret.prime_ids)
    square = mod.mul_mod(secret.data, secret.data, m.q, m.q_inverse)
    return RelinearizationKey(engine._key_switch_key_data(secret, square), secret.prime_ids)


def generate_rotation_key(engine: EngineOperations, secret: SecretKey, step: int) -> RotationKey:
    engine._check_secret(secret)
    step = canonical_rotation_step(step, engine.slot_count)
    element = engine.encoder.rotation_galois_element(step)
    rotated = engine._apply_galois(secret.data, element, "ntt")
    return RotationKey(engine._key_switch_key_data(secret, rotated), secret.prime_ids, rotation_step=step)


def generate_conjugation_key(engine: EngineOperations, secret: SecretKey) -> ConjugationKey:
    engine._check_secret(secret)
    conjugated = engine._apply_galois(secret.data, engine.encoder.conjugation_galois_element, "ntt")
    return ConjugationKey(engine._key_switch_key_data(secret, conjugated), secret.prime_ids)


def generate_keys(
    engine: EngineOperations,
    *,
    relinearization: bool = True,
    rotation_steps: Iterable[int] = (),
    conjugation: bool = False,
) -> KeySet:
    secret = engine.generate_secret_key()
    keys = KeySet(secret, engine.generate_public_key(secret))
    if relinearization:
        keys.relinearization = engine.generate_relinearization_key(secret)
    for step in rotation_steps:
        keys.rotations[step] = engine.generate_rotation_key(secret, step)
    if conjugation:
        keys.conjugation = engine.generate_conjugation_key(secret)
    return keys
