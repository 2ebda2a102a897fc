"""Approximate CKKS behaviour on the toy ring (N = 1024, scale 2^30) and every validation error."""

from __future__ import annotations

import pytest
import torch

from fhelium.core import (
    Ciphertext,
    DepthMismatchError,
    FheliumValueError,
    MaximumDepthError,
    MissingKeyError,
    ParameterMismatchError,
    PrimeMismatchError,
    ScaleMismatchError,
    ShapeMismatchError,
    ValueStateError,
)
from fhelium.engine import CkksEngine, KeySet, Preset

TOLERANCE = 1e-3  # scale 2^30 on N = 1024: observed errors are ~1e-6
ROTATION_STEPS = (1, -2, 5)  # keep in sync with conftest.ROTATION_STEPS


def _slots(engine: CkksEngine, seed: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*batch, engine.slot_count, generator=generator, dtype=torch.float64) * 2 - 1


def _error(engine: CkksEngine, keys: KeySet, ct: Ciphertext, expected: torch.Tensor) -> float:
    return float((engine.decrypt_decode(ct, keys.secret) - expected).abs().max())


def test_encrypt_decrypt_add_sub_negate(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x, y = _slots(toy_engine, 1), _slots(toy_engine, 2)
    cx, cy = toy_engine.encode_encrypt(x, toy_keys.public), toy_engine.encode_encrypt(y, toy_keys.public)
    assert cx.polynomial_domain == "ntt" and cx.prime_ids == toy_engine.q_ids_at(0)
    assert _error(toy_engine, toy_keys, cx, x) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.add(cx, cy), x + y) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.sub(cx, cy), x - y) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.negate(cx), -x) < TOLERANCE
    total = cx.clone()
    toy_engine.add_(total, cy)
    assert _error(toy_engine, toy_keys, total, x + y) < TOLERANCE
    toy_engine.sub_(total, cy)
    assert _error(toy_engine, toy_keys, total, x) < TOLERANCE


def test_complex_slots_and_conjugation(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    z = torch.complex(_slots(toy_engine, 3), _slots(toy_engine, 4))
    cz = toy_engine.encode_encrypt(z, toy_keys.public)
    assert _error(toy_engine, toy_keys, cz, z) < TOLERANCE
    assert toy_keys.conjugation is not None
    assert _error(toy_engine, toy_keys, toy_engine.conjugate(cz, toy_keys.conjugation), z.conj()) < TOLERANCE


def test_multiply_relinearize_rescale(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x, y = _slots(toy_engine, 5), _slots(toy_engine, 6)
    cx, cy = toy_engine.encode_encrypt(x, toy_keys.public), toy_engine.encode_encrypt(y, toy_keys.public)
    product = toy_engine.multiply(cx, cy)
    assert product.component_count == 3 and product.scale == cx.scale * cy.scale
    relinearized = toy_engine.relinearize(product, toy_keys.relin())
    rescaled = toy_engine.rescale(relinearized)
    dropped = toy_engine.moduli[0]
    assert (rescaled.depth, rescaled.prime_ids, rescaled.scale) == (1, (1, 2), product.scale / dropped)
    assert _error(toy_engine, toy_keys, rescaled, x * y) < TOLERANCE
    # a second level: square and rescale again reaches the last depth
    squared = toy_engine.rescale(toy_engine.relinearize(toy_engine.square(rescaled), toy_keys.relin()))
    assert squared.depth == 2 and _error(toy_engine, toy_keys, squared, (x * y) ** 2) < TOLERANCE
    with pytest.raises(MaximumDepthError, match="last depth 2"):
        toy_engine.rescale(squared)


def test_plaintext_operations(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x, y = _slots(toy_engine, 7), _slots(toy_engine, 8)
    cx = toy_engine.encode_encrypt(x, toy_keys.public)
    py = toy_engine.encode(y)
    assert _error(toy_engine, toy_keys, toy_engine.add_plain(cx, py), x + y) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.sub_plain(cx, py), x - y) < TOLERANCE
    product = toy_engine.rescale(toy_engine.multiply_plain(cx, py))
    assert _error(toy_engine, toy_keys, product, x * y) < TOLERANCE
    assert torch.allclose(toy_engine.decode(py).real, y, atol=1e-6)


@pytest.mark.parametrize("step", ROTATION_STEPS)
def test_rotation_matches_torch_roll(toy_engine: CkksEngine, toy_keys: KeySet, step: int) -> None:
    x = _slots(toy_engine, 9)
    cx = toy_engine.encode_encrypt(x, toy_keys.public)
    rotated = toy_engine.rotate(cx, toy_keys.rotation(step))
    assert _error(toy_engine, toy_keys, rotated, torch.roll(x, step)) < TOLERANCE


def test_domain_changes_and_mod_switch(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x = _slots(toy_engine, 10)
    cx = toy_engine.encode_encrypt(x, toy_keys.public)
    coefficient = toy_engine.to_coefficient(cx)
    assert coefficient.polynomial_domain == "coefficient"
    assert torch.equal(toy_engine.to_ntt(coefficient).data, cx.data)
    assert _error(toy_engine, toy_keys, coefficient, x) < TOLERANCE
    switched = toy_engine.mod_switch(cx)
    assert switched.depth == 1 and switched.scale == cx.scale
    assert _error(toy_engine, toy_keys, switched, x) < TOLERANCE
    rescaled_coefficient = toy_engine.rescale(
        toy_engine.to_coefficient(toy_engine.multiply_plain(cx, toy_engine.encode(x)))
    )
    assert _error(toy_engine, toy_keys, rescaled_coefficient, x * x) < TOLERANCE


def test_batched_operations_and_batch_sum(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x, y = _slots(toy_engine, 11, (4,)), _slots(toy_engine, 12, (4,))
    cx, cy = toy_engine.encode_encrypt(x, toy_keys.public), toy_engine.encode_encrypt(y, toy_keys.public)
    assert cx.batch_shape == (4,)
    product = toy_engine.rescale(toy_engine.relinearize(toy_engine.multiply(cx, cy), toy_keys.relin()))
    assert _error(toy_engine, toy_keys, product, x * y) < TOLERANCE
    rotated = toy_engine.rotate(cx, toy_keys.rotation(1))
    assert _error(toy_engine, toy_keys, rotated, torch.roll(x, 1, dims=-1)) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.sum_batch(cx), x.sum(0)) < TOLERANCE
    assert _error(toy_engine, toy_keys, toy_engine.sum(list(cx.unbind_batch())), x.sum(0)) < TOLERANCE
    assert _error(toy_engine, toy_keys, cx.select_batch(2), x[2]) < TOLERANCE


def test_moduli_for_names_unknown_ids(toy_engine: CkksEngine) -> None:
    assert toy_engine.moduli_for([2, 0]) == [toy_engine.moduli[2], toy_engine.moduli[0]]
    with pytest.raises(ParameterMismatchError, match="prime id 9"):
        toy_engine.moduli_for([9])


def test_validation_errors_name_the_values(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    engine, keys = toy_engine, toy_keys
    x = _slots(engine, 13)
    a = engine.encode_encrypt(x, keys.public)
    b = engine.encode_encrypt(x, keys.public, scale=2.0**29)
    with pytest.raises(
        ScaleMismatchError,
        match=r"add requires exactly equal scales: lhs.scale=1073741824.0, rhs.scale=536870912.0, ratio=2.0",
    ):
        engine.add(a, b)
    deeper = engine.mod_switch(a)
    with pytest.raises(DepthMismatchError, match=r"lhs\.depth=0, rhs\.depth=1"):
        engine.add(a, deeper)
    with pytest.raises(PrimeMismatchError, match=r"equal primes: lhs\.prime_ids=\[0\], rhs\.prime_ids=\[1\]"):
        engine.add(a.slice_limbs(0, 1), a.slice_limbs(1, 2))
    coefficient = engine.to_coefficient(a)
    with pytest.raises(ValueStateError, match="requires equal polynomial_domain"):
        engine.add(a, coefficient)
    with pytest.raises(ValueStateError, match="multiply lhs must have polynomial_domain='ntt'"):
        engine.multiply(coefficient, coefficient)
    with pytest.raises(ValueStateError, match="relinearize input must have 3 components"):
        engine.relinearize(a, keys.relin())
    with pytest.raises(PrimeMismatchError, match="rescale needs every active Q limb"):
        engine.rescale(a.slice_limbs(0, 2))
    with pytest.raises(ShapeMismatchError, match="equal shapes"):
        engine.add(a, engine.encode_encrypt(x.expand(2, -1), keys.public))
    with pytest.raises(MissingKeyError, match="no rotation key for step 7"):
        keys.rotation(7)
    with pytest.raises(FheliumValueError, match="rotate needs a RotationKey"):
        engine.rotate(a, keys.relin())  # type: ignore[arg-type]  # deliberately wrong key
    with pytest.raises(ScaleMismatchError, match="add_plain requires exactly equal scales"):
        engine.add_plain(a, engine.encode(x, scale=2.0**20))
    with pytest.raises(DepthMismatchError, match=r"ciphertext\.depth=0, plaintext\.depth=1"):
        engine.multiply_plain(a, engine.encode(x, depth=1))
    with pytest.raises(FheliumValueError, match="encode got 600 slots; this engine has 512"):
        engine.encode(torch.zeros(600))
    with pytest.raises(FheliumValueError, match="too large for scale"):
        engine.encode(torch.full((4,), 1e12))
    other = CkksEngine(Preset.TOY_N2048, rng_seed=1)
    with pytest.raises(ParameterMismatchError, match="ring dimension 1024; this engine uses N=2048"):
        other.add(a, a)
    montgomery = Ciphertext(a.data, 0, a.scale, a.prime_ids, "ntt", "Q", "montgomery")
    with pytest.raises(ValueStateError, match="Montgomery residues"):
        engine.add(montgomery, montgomery)


def test_encrypt_at_depth_and_three_component_decrypt(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x = _slots(toy_engine, 14)
    deep = toy_engine.encode_encrypt(x, toy_keys.public, depth=1)
    assert deep.depth == 1 and deep.prime_ids == toy_engine.q_ids_at(1)
    assert _error(toy_engine, toy_keys, deep, x) < TOLERANCE
    fresh = toy_engine.encode_encrypt(x, toy_keys.public)
    assert _error(toy_engine, toy_keys, toy_engine.multiply(fresh, fresh), x * x) < TOLERANCE
    ntt_plain = toy_engine.encode(x, depth=2)
    assert _error(toy_engine, toy_keys, toy_engine.encrypt(ntt_plain, toy_keys.public), x) < TOLERANCE
    assert torch.allclose(toy_engine.decode(ntt_plain).real, x, atol=1e-6)


def test_rotate_by_step_accepts_keysets_and_mappings(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x = _slots(toy_engine, 15)
    cx = toy_engine.encode_encrypt(x, toy_keys.public)
    by_set = toy_engine.rotate_by_step(cx, -2, toy_keys)
    by_map = toy_engine.rotate_by_step(cx, toy_engine.slot_count - 2, toy_keys.rotations)
    assert torch.equal(by_set.data, by_map.data)
    assert _error(toy_engine, toy_keys, by_set, torch.roll(x, -2)) < TOLERANCE
    with pytest.raises(MissingKeyError, match="no rotation key for step 3"):
        toy_engine.rotate_by_step(cx, 3, toy_keys.rotations)


def test_rotate_many_is_bit_identical_to_single_rotations(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    x = _slots(toy_engine, 16, (2,))
    cx = toy_engine.encode_encrypt(x, toy_keys.public)
    keys = [toy_keys.rotation(step) for step in ROTATION_STEPS]
    hoisted = toy_engine.rotate_many(cx, keys)
    for key, result in zip(keys, hoisted, strict=True):
        assert torch.equal(result.data, toy_engine.rotate(cx, key).data)
    with pytest.raises(FheliumValueError, match="rotate_many needs RotationKeys"):
        toy_engine.rotate_many(cx, [toy_keys.relin()])  # type: ignore[list-item]  # deliberately wrong key


def test_batched_key_switching_in_groups_matches_one_pass(
    toy_engine: CkksEngine, toy_keys: KeySet, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fhelium.engine.keyswitch as keyswitch_module

    x = _slots(toy_engine, 17, (3,))
    product = toy_engine.multiply(*(toy_engine.encode_encrypt(x, toy_keys.public),) * 2)
    one_pass = toy_engine.relinearize(product, toy_keys.relin())
    monkeypatch.setattr(keyswitch_module, "KEY_SWITCH_BLOCK_RESIDUES", 1)  # one ciphertext per group
    grouped = toy_engine.relinearize(product, toy_keys.relin())
    assert torch.equal(grouped.data, one_pass.data)


def test_grouped_batch_operations_match_one_pass(
    toy_engine: CkksEngine, toy_keys: KeySet, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fhelium.engine.base as base_module

    x, y = _slots(toy_engine, 18, (2, 3)), _slots(toy_engine, 19, (2, 3))
    cx, cy = toy_engine.encode_encrypt(x, toy_keys.public), toy_engine.encode_encrypt(y, toy_keys.public)
    plain = toy_engine.encode(y)
    key = toy_keys.rotation(1)

    def pipeline() -> dict[str, torch.Tensor]:
        product = toy_engine.multiply(cx, cy)
        return {
            "multiply": product.data,
            "relinearize": toy_engine.relinearize(product, toy_keys.relin()).data,
            "rescale": toy_engine.rescale(cx).data,
            "multiply_plain": toy_engine.multiply_plain(cx, plain).data,
            "rotate": toy_engine.rotate(cx, key).data,
            "decrypt": toy_engine.decrypt(cx, toy_keys.secret).tensor,
        }

    one_pass = pipeline()
    monkeypatch.setattr(base_module, "BATCH_BLOCK_RESIDUES", 1)  # one ciphertext per group
    grouped = pipeline()
    assert {name: torch.equal(grouped[name], one_pass[name]) for name in one_pass} == dict.fromkeys(
        one_pass, True
    )
    encrypted = toy_engine.encode_encrypt(x, toy_keys.public)
    assert encrypted.batch_shape == (2, 3) and _error(toy_engine, toy_keys, encrypted, x) < TOLERANCE
