"""Key switching of a ``CkksEngine``: digit decomposition, inner product, relinearization, rotations."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium import native as _native
from fhelium.core import (
    Ciphertext,
    ConjugationKey,
    FheliumValueError,
    KeySwitchKey,
    MissingKeyError,
    ParameterMismatchError,
    RelinearizationKey,
    RotationKey,
    canonical_rotation_step,
)
from fhelium.engine.compiled import compile_kernel
from fhelium.engine.keyset import KeySet
from fhelium.engine.operations import EngineOperations

# Ciphertext rows switched per group in batched key switching (see key_switch).
KEY_SWITCH_BLOCK_RESIDUES = 1 << 17


@functools.lru_cache(maxsize=256)
def _index_tensor(ids: tuple[int, ...]) -> torch.Tensor:
    """The prime (or key digit / key row) ids as an int64 CPU tensor, for the native ops."""
    return torch.tensor(ids, dtype=torch.int64)


@functools.cache
def _compiled_inner_product() -> Callable[..., torch.Tensor]:
    """``modular.digit_inner_product`` through torch.compile (opt-in, once per process)."""
    return compile_kernel(mod.digit_inner_product)


def _native_key_switch(
    engine: EngineOperations, operand: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey, *, lifted: bool
) -> torch.Tensor:
    """The native key switch of ``operand`` over ``ids``: an NTT polynomial, or (``lifted``) its digits."""
    qp_ids = (*ids, engine.special_prime_id)
    return _native.key_switch(
        operand,
        key.data,
        _index_tensor(ids),
        _index_tensor(qp_ids),
        *engine.ntt._native_tables(qp_ids),
        engine.ntt.native_level,
        lifted=lifted,
    )


def check_switch_key(engine: EngineOperations, key: KeySwitchKey) -> None:
    if key.prime_ids != tuple(range(len(engine.moduli))) or key.digit_count != engine.q_count:
        raise ParameterMismatchError(
            f"{type(key).__name__} does not match this engine: expected {engine.q_count} digits over prime "
            f"ids 0..{len(engine.moduli) - 1}; got {key.digit_count} digits over {list(key.prime_ids)}"
        )


def decompose(engine: EngineOperations, poly_ntt: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    """One digit per active Q prime (its centered residue), lifted to every QP prime, NTT.

    ``[*batch, L, N]`` → ``[L, *batch, L+1, N]``. Galois maps commute with this step, which is
    what lets ``rotate_many`` decompose once for many rotations.
    """
    qp_ids = (*ids, engine.special_prime_id)
    if engine.ntt.native_level != "torch":
        return _native.decompose(poly_ntt, *engine.ntt._native_tables(qp_ids), engine.ntt.native_level)
    coefficients = engine.ntt.inverse(poly_ntt, ids)
    digits = mod.center(coefficients, engine._mod(ids).q).movedim(-2, 0).unsqueeze(-2)
    return engine.ntt.forward(torch.remainder(digits, engine._mod(qp_ids).q), qp_ids)


def inner_product(
    engine: EngineOperations, lifted: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey
) -> torch.Tensor:
    """Σ_j digit_j · key_j over QP, then ModDown: ``[2, *batch, L, N]`` in the NTT domain."""
    engine._check_switch_key(key)
    if engine.ntt.native_level != "torch":
        return _native_key_switch(engine, lifted, ids, key, lifted=True)
    qp_ids = (*ids, engine.special_prime_id)
    qp_mod = engine._mod(qp_ids)
    key_rows = key.data[list(ids)][:, :, list(qp_ids)]  # [L, 2, L+1, N]
    key_rows = key_rows.view(len(ids), 2, 1, len(qp_ids), engine.ring_degree)
    kernel = _compiled_inner_product() if engine.ntt.compiled else mod.digit_inner_product
    flat = lifted.reshape(len(ids), -1, len(qp_ids), engine.ring_degree)  # one rank for every batch
    accumulated = kernel(flat, key_rows, qp_mod.q, qp_mod.q_inverse)
    return engine._mod_down(accumulated.view(2, *lifted.shape[1:]), ids)


def key_switch(
    engine: EngineOperations, poly_ntt: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey
) -> torch.Tensor:
    """Switch ``poly·s_src`` to (b0 + b1·s): returns ``[2, *batch, rows, N]`` in the NTT domain.

    Batches are switched a few ciphertexts at a time: the lifted digits are L+1 times the
    input, and keeping them cache-sized measured faster than one pass over a large batch.
    """
    engine._check_switch_key(key)
    if engine.ntt.native_level != "torch":  # the whole pipeline in one native call
        return _native_key_switch(engine, poly_ntt, ids, key, lifted=False)
    batch_shape = poly_ntt.shape[:-2]
    flat = poly_ntt.reshape(-1, *poly_ntt.shape[-2:])
    per_group = max(1, KEY_SWITCH_BLOCK_RESIDUES // (len(ids) * engine.ring_degree))
    if flat.size(0) <= per_group:
        return engine._inner_product(engine._decompose(poly_ntt, ids), ids, key)
    parts = [
        engine._inner_product(engine._decompose(flat[start : start + per_group], ids), ids, key)
        for start in range(0, flat.size(0), per_group)
    ]
    return torch.cat(parts, dim=1).view(2, *batch_shape, len(ids), engine.ring_degree)


def relinearize(engine: EngineOperations, value: Ciphertext, key: RelinearizationKey) -> Ciphertext:
    """3-component NTT ciphertext → 2 components, via key switching of the s² term."""
    ct = engine._check_ciphertext(value, "ciphertext")
    ct.assert_state(polynomial_domain="ntt", components=3, name="relinearize input")
    if not isinstance(key, RelinearizationKey):
        raise FheliumValueError(f"relinearize needs a RelinearizationKey; got {type(key).__name__}")
    ids = engine._check_full_layout(ct, "ciphertext", "relinearize")
    groups = engine._batch_groups(ct.batch_shape, ct.limb_count)
    if groups is not None:
        parts = [engine.relinearize(engine._ciphertext_part(ct, g), key) for g in groups]
        return engine._join(parts, ct.batch_shape)
    switched = engine._key_switch(ct.data[2], ids, key)
    q = engine._mod(ids).q
    return ct.with_data(mod.add_mod(ct.data[:2], switched, q))


def galois_switch(
    engine: EngineOperations, value: Ciphertext, element: int, key: KeySwitchKey, operation: str
) -> Ciphertext:
    ct = engine._check_ciphertext(value, "ciphertext")
    ct.assert_state(polynomial_domain="ntt", components=2, name=f"{operation} input")
    ids = engine._check_full_layout(ct, "ciphertext", operation)
    groups = engine._batch_groups(ct.batch_shape, ct.limb_count)
    if groups is not None:
        parts = [
            engine._galois_switch(engine._ciphertext_part(ct, g), element, key, operation) for g in groups
        ]
        return engine._join(parts, ct.batch_shape)
    permuted = engine._apply_galois(ct.data, element, "ntt")
    switched = engine._key_switch(permuted[1], ids, key)
    q = engine._mod(ids).q
    mod.add_mod_(switched[0], permuted[0], q)
    return ct.with_data(switched)


def rotate(engine: EngineOperations, value: Ciphertext, key: RotationKey) -> Ciphertext:
    """Slots m → ``torch.roll(m, key.rotation_step)``."""
    if not isinstance(key, RotationKey):
        raise FheliumValueError(f"rotate needs a RotationKey; got {type(key).__name__}")
    element = engine.encoder.rotation_galois_element(key.rotation_step)
    return engine._galois_switch(value, element, key, "rotate")


def rotate_many(engine: EngineOperations, value: Ciphertext, keys: Sequence[RotationKey]) -> list[Ciphertext]:
    """Several rotations of one ciphertext sharing one digit decomposition (hoisting).

    Bit-identical to calling ``rotate`` per key; saves the decomposition's L·(L+1) row NTTs
    for every rotation after the first.
    """
    ct = engine._check_ciphertext(value, "ciphertext")
    ct.assert_state(polynomial_domain="ntt", components=2, name="rotate_many input")
    ids = engine._check_full_layout(ct, "ciphertext", "rotate_many")
    for key in keys:
        if not isinstance(key, RotationKey):
            raise FheliumValueError(f"rotate_many needs RotationKeys; got {type(key).__name__}")
    lifted = engine._decompose(ct.data[1], ids)
    q = engine._mod(ids).q
    results = []
    for key in keys:
        element = engine.encoder.rotation_galois_element(key.rotation_step)
        switched = engine._inner_product(engine._apply_galois(lifted, element, "ntt"), ids, key)
        mod.add_mod_(switched[0], engine._apply_galois(ct.data[0], element, "ntt"), q)
        results.append(ct.with_data(switched))
    return results


def rotate_by_step(
    engine: EngineOperations, value: Ciphertext, step: int, keys: KeySet | Mapping[int, RotationKey]
) -> Ciphertext:
    """Rotate by ``step`` slots using the matching key from a KeySet or a step → key mapping."""
    if isinstance(keys, KeySet):
        return engine.rotate(value, keys.rotation(step))
    canonical = canonical_rotation_step(step, engine.slot_count)
    for key in keys.values():
        if key.rotation_step == canonical:
            return engine.rotate(value, key)
    raise MissingKeyError(f"no rotation key for step {step} (canonical {canonical}) among {sorted(keys)}")


def conjugate(engine: EngineOperations, value: Ciphertext, key: ConjugationKey) -> Ciphertext:
    """Complex-conjugate every slot."""
    if not isinstance(key, ConjugationKey):
        raise FheliumValueError(f"conjugate needs a ConjugationKey; got {type(key).__name__}")
    return engine._galois_switch(value, engine.encoder.conjugation_galois_element, key, "conjugate")
