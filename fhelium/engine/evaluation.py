"""Homomorphic evaluation of a ``CkksEngine``: add/sub/negate/sum, plaintext operations, multiply,
rescale and mod switch, domain changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium import native as _native
from fhelium.core import Ciphertext, FheliumValueError, MaximumDepthError, Plaintext
from fhelium.engine.operations import EngineOperations


def _pairwise(
    engine: EngineOperations,
    lhs: Ciphertext,
    rhs: Ciphertext,
    operation: str,
    op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``op(lhs.data, rhs.data, q)`` over lhs's primes, once ``_check_pair`` accepts the pair."""
    engine._check_pair(lhs, rhs, operation)
    return op(lhs.data, rhs.data, engine._mod(lhs.prime_ids).q)


def add(engine: EngineOperations, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
    return lhs.with_data(_pairwise(engine, lhs, rhs, "add", mod.add_mod))


def add_(engine: EngineOperations, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
    """In place: ``lhs += rhs`` in lhs's storage (also through a ``slice_limbs`` view); returns lhs."""
    _pairwise(engine, lhs, rhs, "add_", mod.add_mod_)
    return lhs


def sub(engine: EngineOperations, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
    return lhs.with_data(_pairwise(engine, lhs, rhs, "sub", mod.sub_mod))


def sub_(engine: EngineOperations, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
    _pairwise(engine, lhs, rhs, "sub_", mod.sub_mod_)
    return lhs


def negate(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    engine._check_ciphertext(value, "value")
    return value.with_data(mod.neg_mod(value.data, engine._mod(value.prime_ids).q))


def negate_(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    engine._check_ciphertext(value, "value")
    value.data.copy_(mod.neg_mod(value.data, engine._mod(value.prime_ids).q))
    return value


def sum(engine: EngineOperations, values: Sequence[Ciphertext]) -> Ciphertext:
    if not values:
        raise FheliumValueError("sum needs at least one ciphertext")
    total = values[0].clone()
    for value in values[1:]:
        engine.add_(total, value)
    return total


def sum_batch(engine: EngineOperations, value: Ciphertext, dim: int = 0) -> Ciphertext:
    """Modular sum over batch axis ``dim``; the result drops that axis."""
    engine._check_ciphertext(value, "value")
    if not 0 <= dim < len(value.batch_shape):
        raise FheliumValueError(f"sum_batch dim must be in [0, {len(value.batch_shape)}); got {dim}")
    q = engine._mod(value.prime_ids).q
    axis = 1 + dim
    # int64 holds a sum of up to 2**13 residues below 2**50; fold in chunks beyond that
    chunks = torch.split(value.data, 1 << 13, dim=axis)
    total = torch.remainder(chunks[0].sum(dim=axis), q)
    for chunk in chunks[1:]:
        total = mod.add_mod(total, torch.remainder(chunk.sum(dim=axis), q), q)
    return value.with_data(total)


def add_plain(engine: EngineOperations, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
    return engine._with_plain_in_c0(ct, pt, "add_plain", mod.add_mod_)


def sub_plain(engine: EngineOperations, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
    return engine._with_plain_in_c0(ct, pt, "sub_plain", mod.sub_mod_)


def with_plain_in_c0(
    engine: EngineOperations,
    ct: Ciphertext,
    pt: Plaintext,
    operation: str,
    combine_: Callable[..., torch.Tensor],
) -> Ciphertext:
    """A copy of ``ct`` whose c0 is combined (in place, modularly) with the plaintext."""
    engine._check_ciphertext(ct, "ciphertext")
    pt = engine._check_plaintext(ct, pt, operation, same_scale=True)
    assert pt.data is not None
    data = ct.data.clone()
    combine_(data[0], pt.data, engine._mod(ct.prime_ids).q)
    return ct.with_data(data)


def multiply_plain(engine: EngineOperations, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
    """Pointwise product with an NTT plaintext; scales multiply (rescale afterwards)."""
    engine._check_ciphertext(ct, "ciphertext")
    ct.assert_state(polynomial_domain="ntt", name="multiply_plain ciphertext")
    pt = engine._check_plaintext(ct, pt, "multiply_plain", same_scale=False)
    assert pt.data is not None
    groups = engine._batch_groups(ct.batch_shape, ct.limb_count)
    if groups is not None and pt.batch_shape in ((), ct.batch_shape):
        parts = [
            engine.multiply_plain(engine._ciphertext_part(ct, g), engine._plaintext_part(pt, g))
            for g in groups
        ]
        return engine._join(parts, ct.batch_shape)
    m = engine._mod(ct.prime_ids)
    data = mod.mul_mod(ct.data, pt.data, m.q, m.q_inverse)
    return Ciphertext(data, ct.depth, ct.scale * pt.scale, ct.prime_ids, "ntt", ct.modulus_basis)


def multiply(engine: EngineOperations, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
    """(a0, a1)·(b0, b1) → (a0b0, a0b1 + a1b0, a1b1), NTT domain, scale lhs.scale·rhs.scale."""
    engine._check_pair(lhs, rhs, "multiply", same_scale=False)
    for value, name in ((lhs, "lhs"), (rhs, "rhs")):
        value.assert_state(polynomial_domain="ntt", components=2, name=f"multiply {name}")
    groups = engine._batch_groups(lhs.batch_shape, lhs.limb_count)
    if groups is not None:
        parts = [
            engine.multiply(engine._ciphertext_part(lhs, g), engine._ciphertext_part(rhs, g)) for g in groups
        ]
        return engine._join(parts, lhs.batch_shape)
    if engine.ntt.native_level != "torch":  # one native pass, the same residues
        moduli = engine.ntt._native_tables(lhs.prime_ids)[0]
        data = _native.tensor_product(lhs.data, rhs.data, moduli, engine.ntt.native_level)
        return Ciphertext(data, lhs.depth, lhs.scale * rhs.scale, lhs.prime_ids, "ntt")
    m = engine._mod(lhs.prime_ids)
    a0, a1 = lhs.data[0], lhs.data[1]
    b0, b1 = rhs.data[0], rhs.data[1]
    # Karatsuba: a0b1 + a1b0 = (a0+a1)(b0+b1) - a0b0 - a1b1 saves one product
    d0 = mod.mul_mod(a0, b0, m.q, m.q_inverse)
    d2 = mod.mul_mod(a1, b1, m.q, m.q_inverse)
    cross = mod.mul_mod(mod.add_mod(a0, a1, m.q), mod.add_mod(b0, b1, m.q), m.q, m.q_inverse)
    d1 = mod.sub_mod_(mod.sub_mod_(cross, d0, m.q), d2, m.q)
    return Ciphertext(torch.stack((d0, d1, d2)), lhs.depth, lhs.scale * rhs.scale, lhs.prime_ids, "ntt")


def square(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    return engine.multiply(value, value)


def rescale(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    """Divide by the leading prime with rounding: depth + 1, scale / q_dropped."""
    ct = engine._check_ciphertext(value, "ciphertext")
    ids = engine._check_full_layout(ct, "ciphertext", "rescale")
    if len(ids) < 2:
        raise MaximumDepthError(
            f"rescale: ciphertext is at the last depth {ct.depth} (only the base prime is left)"
        )
    groups = engine._batch_groups(ct.batch_shape, ct.limb_count)
    if groups is not None:
        return engine._join([engine.rescale(engine._ciphertext_part(ct, g)) for g in groups], ct.batch_shape)
    dropped, rest = ids[0], ids[1:]
    q_drop = engine.moduli[dropped]
    if engine.ntt.native_level != "torch":
        data = _native.divide_round(
            ct.data,
            *engine.ntt._native_tables(ids),
            0,
            ntt=ct.polynomial_domain == "ntt",
            level=engine.ntt.native_level,
        )
        return Ciphertext(data, ct.depth + 1, ct.scale / q_drop, rest, ct.polynomial_domain)
    rest_mod = engine._mod(rest)
    last = ct.data[..., :1, :]
    if ct.polynomial_domain == "ntt":
        last = engine.ntt.inverse(last, (dropped,))
    centered = mod.center(last, engine._mod((dropped,)).q)
    correction = torch.remainder(centered, rest_mod.q)
    if ct.polynomial_domain == "ntt":
        correction = engine.ntt.forward(correction, rest)
    difference = mod.sub_mod(ct.data[..., 1:, :], correction, rest_mod.q)
    inverse, inverse_over_q = engine._inverse_constants(q_drop, rest)
    data = mod.mul_mod_shoup(difference, inverse, inverse_over_q, rest_mod.q)
    return Ciphertext(data, ct.depth + 1, ct.scale / q_drop, rest, ct.polynomial_domain)


def mod_switch(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    """Drop the leading prime without dividing: depth + 1, same scale (to align depths)."""
    ct = engine._check_ciphertext(value, "ciphertext")
    ids = engine._check_full_layout(ct, "ciphertext", "mod_switch")
    if len(ids) < 2:
        raise MaximumDepthError(f"mod_switch: ciphertext is at the last depth {ct.depth}")
    return Ciphertext(ct.data[..., 1:, :].contiguous(), ct.depth + 1, ct.scale, ids[1:], ct.polynomial_domain)


def mod_switch_plain(engine: EngineOperations, pt: Plaintext) -> Plaintext:
    if pt.representation != "rns" or pt.data is None:
        raise FheliumValueError("mod_switch_plain needs an rns Plaintext")
    return Plaintext(
        None,
        pt.depth + 1,
        pt.scale,
        pt.data[..., 1:, :].contiguous(),
        "rns",
        pt.polynomial_domain,
        pt.modulus_basis,
        pt.residue_representation,
        pt.prime_ids[1:],
    )


def to_ntt(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    ct = engine._check_ciphertext(value, "ciphertext")
    ct.assert_state(polynomial_domain="coefficient", name="to_ntt input")
    data = engine.ntt.forward(ct.data, ct.prime_ids)
    return Ciphertext(data, ct.depth, ct.scale, ct.prime_ids, "ntt", ct.modulus_basis)


def to_coefficient(engine: EngineOperations, value: Ciphertext) -> Ciphertext:
    ct = engine._check_ciphertext(value, "ciphertext")
    ct.assert_state(polynomial_domain="ntt", name="to_coefficient input")
    data = engine.ntt.inverse(ct.data, ct.prime_ids)
    return Ciphertext(data, ct.depth, ct.scale, ct.prime_ids, "coefficient", ct.modulus_basis)
