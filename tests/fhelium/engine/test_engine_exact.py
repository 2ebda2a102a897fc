"""Rescale, key switching and rotation checked bit-exactly against Python big integers (N = 16)."""

from __future__ import annotations

import random

import torch
from ckks_bigint_reference import centered, crt_poly, galois, negacyclic_product, residues_of

from fhelium.core import Ciphertext, KeySwitchKey
from fhelium.engine import CkksEngine


def _coefficients(engine: CkksEngine, ntt_rows: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    return engine.ntt.inverse(ntt_rows, ids)


def _fresh(engine: CkksEngine, keys_seed: int = 0) -> tuple[Ciphertext, object]:
    keys = engine.generate_keys(rotation_steps=(1, 3), conjugation=True)
    slots = torch.linspace(-1, 1, engine.slot_count, dtype=torch.float64)
    return engine.encode_encrypt(slots, keys.public), keys


def _reference_key_switch(
    engine: CkksEngine, poly_coefficients: list[int], ids: tuple[int, ...], key: KeySwitchKey
) -> list[list[int]]:
    """Σ_j center(poly mod q_j)·K_j over QP, then divide-and-round by P, reduced mod Q_active."""
    qp_ids = (*ids, engine.special_prime_id)
    qp_moduli = engine.moduli_for(qp_ids)
    big_qp = 1
    for q in qp_moduli:
        big_qp *= q
    special = engine.moduli[engine.special_prime_id]
    out = []
    for component in range(2):
        accumulator = [0] * engine.ring_degree
        for j in ids:
            digit = [centered(c, engine.moduli[j]) for c in poly_coefficients]
            key_poly = crt_poly(
                _coefficients(engine, key.data[j, component, list(qp_ids)], qp_ids), qp_moduli
            )
            product = negacyclic_product(digit, key_poly, big_qp)
            accumulator = [(x + y) % big_qp for x, y in zip(accumulator, product, strict=True)]
        out.append([(c - centered(c, special)) // special for c in accumulator])
    return out


def test_rescale_matches_big_integer_divide_and_round(tiny_engine: CkksEngine) -> None:
    ct, _ = _fresh(tiny_engine)
    ids = ct.prime_ids
    moduli = tiny_engine.moduli_for(ids)
    q_drop = moduli[0]
    rescaled = tiny_engine.to_coefficient(tiny_engine.rescale(ct))
    coefficient = tiny_engine.to_coefficient(ct)
    for component in range(2):
        big = crt_poly(coefficient.data[component], moduli)
        expected = [(c - centered(c, q_drop)) // q_drop for c in big]
        assert torch.equal(rescaled.data[component], residues_of(expected, moduli[1:]))
    assert rescaled.scale == ct.scale / q_drop and rescaled.prime_ids == ids[1:]


def test_relinearization_key_switch_matches_big_integers(tiny_engine: CkksEngine) -> None:
    ct, keys = _fresh(tiny_engine)
    product = tiny_engine.multiply(ct, ct)
    relinearized = tiny_engine.relinearize(product, keys.relin())  # type: ignore[attr-defined]
    ids = ct.prime_ids
    moduli = tiny_engine.moduli_for(ids)
    d2 = crt_poly(_coefficients(tiny_engine, product.data[2], ids), moduli)
    switched = _reference_key_switch(tiny_engine, d2, ids, keys.relin())  # type: ignore[attr-defined]
    for component in range(2):
        expected = residues_of(switched[component], moduli)
        base = _coefficients(tiny_engine, product.data[component], ids)
        actual = _coefficients(tiny_engine, relinearized.data[component], ids)
        assert torch.equal((actual - base) % torch.tensor(moduli).unsqueeze(-1), expected)


def test_rotation_matches_big_integer_automorphism_and_key_switch(tiny_engine: CkksEngine) -> None:
    ct, keys = _fresh(tiny_engine)
    key = keys.rotation(3)  # type: ignore[attr-defined]
    rotated = tiny_engine.rotate(ct, key)
    ids = ct.prime_ids
    moduli = tiny_engine.moduli_for(ids)
    big_q = 1
    for q in moduli:
        big_q *= q
    element = tiny_engine.encoder.rotation_galois_element(3)
    c0 = galois(crt_poly(_coefficients(tiny_engine, ct.data[0], ids), moduli), element, big_q)
    c1 = galois(crt_poly(_coefficients(tiny_engine, ct.data[1], ids), moduli), element, big_q)
    switched = _reference_key_switch(tiny_engine, c1, ids, key)
    expected0 = residues_of([a + b for a, b in zip(c0, switched[0], strict=True)], moduli)
    expected1 = residues_of(switched[1], moduli)
    assert torch.equal(_coefficients(tiny_engine, rotated.data[0], ids), expected0)
    assert torch.equal(_coefficients(tiny_engine, rotated.data[1], ids), expected1)


def test_add_on_a_limb_slice_is_per_limb_modular_addition(tiny_engine: CkksEngine) -> None:
    ids = tiny_engine.q_ids_at(0)
    moduli = tiny_engine.moduli_for(ids)
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, q, (2, 1, tiny_engine.ring_degree), generator=generator) for q in moduli]
    lhs = Ciphertext(torch.cat(rows, dim=1), 0, 2.0**20, ids, "ntt")
    rhs_rows = [torch.randint(0, q, (2, 1, tiny_engine.ring_degree), generator=generator) for q in moduli]
    rhs = Ciphertext(torch.cat(rhs_rows, dim=1), 0, 2.0**20, ids, "ntt")
    before = lhs.data.clone()
    result = tiny_engine.add_(lhs.slice_limbs(1, 3), rhs.slice_limbs(1, 3))
    assert result.data.data_ptr() == lhs.data[:, 1:].data_ptr()
    assert torch.equal(lhs.data[:, 0], before[:, 0])
    for limb in (1, 2):
        expected = [
            [(a + b) % moduli[limb] for a, b in zip(x, y, strict=True)]
            for x, y in zip(before[:, limb].tolist(), rhs.data[:, limb].tolist(), strict=True)
        ]
        assert lhs.data[:, limb].tolist() == expected
    assert tiny_engine.moduli_for(lhs.slice_limbs(1, 3).prime_ids) == moduli[1:3]


def test_mod_down_divides_the_divided_term_and_adds_the_addend(tiny_engine: CkksEngine) -> None:
    """ModDown with both extra terms (as encryption uses it) against big-integer divide-and-round:
    result = (V − center(V mod P)) / P + addend over Q, where V = values + divided over QP.
    """
    engine = tiny_engine
    ids = engine.q_ids_at(0)
    qp_ids = (*ids, engine.special_prime_id)
    qp_moduli, q_moduli = engine.moduli_for(qp_ids), engine.moduli_for(ids)
    special = qp_moduli[-1]
    big_qp = 1
    for modulus in qp_moduli:
        big_qp *= modulus
    rng = random.Random(5)
    n = engine.ring_degree
    coefficients = [rng.randrange(big_qp) for _ in range(n)]
    coefficients[:2] = [big_qp - 1, 0]  # wrap-around edges once the divided term is added
    divided = [rng.randrange(-20, 21) for _ in range(n)]
    divided[:2] = [5, -5]
    addend = [rng.randrange(-50, 51) for _ in range(n)]
    values = engine.ntt.forward(residues_of(coefficients, qp_moduli), qp_ids)
    result = engine._mod_down(
        values.unsqueeze(0),
        ids,
        residues_of(addend, q_moduli).unsqueeze(0),
        torch.tensor(divided).view(1, 1, n),
    )
    got = engine.ntt.inverse(result[0], ids)
    expected = []
    for value, small, extra in zip(coefficients, divided, addend, strict=True):
        total = (value + small) % big_qp
        remainder = centered(total, special)
        expected.append((total - remainder) // special + extra)
    assert torch.equal(got, residues_of(expected, q_moduli))
