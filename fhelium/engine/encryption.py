"""Encoding, encryption (public-key, integer, symmetric, seeded) and decryption of a ``CkksEngine``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium import native as _native
from fhelium.core import (
    Ciphertext,
    FheliumValueError,
    ParameterMismatchError,
    Plaintext,
    PolynomialDomain,
    PrimeMismatchError,
    PublicKey,
    SecretKey,
    SeededCiphertext,
    ValueStateError,
)
from fhelium.engine.operations import EngineOperations
from fhelium.engine.parameters import ERROR_STANDARD_DEVIATION
from fhelium.engine.sampling import RandomSource

# Coefficients of an encoded message must stay well inside int64.
_MAX_ENCODED_MAGNITUDE = 2.0**62


def encode(
    engine: EngineOperations,
    values: torch.Tensor | Sequence[complex] | float,
    *,
    depth: int = 0,
    scale: float | None = None,
    domain: PolynomialDomain = "ntt",
) -> Plaintext:
    """Slots ``[*batch, ≤S]`` (real or complex; a scalar fills every slot) → rns Plaintext."""
    scale = engine.default_scale if scale is None else float(scale)
    ids = engine.q_ids_at(depth)
    message = torch.as_tensor(values).cpu()
    if message.ndim == 0:
        message = message.expand(engine.slot_count)
    if message.size(-1) > engine.slot_count:
        raise FheliumValueError(
            f"encode got {message.size(-1)} slots; this engine has {engine.slot_count} (N/2)"
        )
    if message.size(-1) < engine.slot_count:
        pad = torch.zeros(*message.shape[:-1], engine.slot_count - message.size(-1), dtype=message.dtype)
        message = torch.cat((message, pad), dim=-1)
    coefficients = engine.encoder.slots_to_coefficients(message.cpu()) * scale
    largest = float(coefficients.abs().max()) if coefficients.numel() else 0.0
    if not math.isfinite(largest) or largest >= _MAX_ENCODED_MAGNITUDE:
        raise FheliumValueError(
            f"encoded coefficients reach {largest:.3g}, beyond 2^62: the message is too large for "
            f"scale {scale!r} (reduce the scale or the values)"
        )
    integers = coefficients.round().long().to(engine.device)
    residues = torch.remainder(integers.unsqueeze(-2), engine._mod(ids).q)
    if domain == "ntt":
        residues = engine.ntt.forward(residues, ids)
    return Plaintext(None, depth, scale, residues, "rns", domain, "Q", "standard", ids)


def decode(engine: EngineOperations, plaintext: Plaintext) -> torch.Tensor:
    """An rns or approximate-coefficient Plaintext → complex128 slots ``[*batch, S]`` on CPU."""
    if not isinstance(plaintext, Plaintext) or plaintext.data is None:
        raise FheliumValueError("decode needs a Plaintext with coefficient data (rns or approximate)")
    if plaintext.representation == "approximate_coefficients":
        coefficients = plaintext.data
    elif plaintext.representation == "rns":
        data = plaintext.data
        if plaintext.polynomial_domain == "ntt":
            data = engine.ntt.inverse(data[..., -2:, :], plaintext.prime_ids[-2:])
        coefficients = engine._reconstruct(data, plaintext.prime_ids[-2:])
    else:
        raise FheliumValueError(f"decode cannot read a {plaintext.representation!r} Plaintext")
    return engine.encoder.coefficients_to_slots(coefficients.cpu() / plaintext.scale)


def encrypt(engine: EngineOperations, plaintext: Plaintext, public_key: PublicKey) -> Ciphertext:
    """Public-key encryption of an rns Plaintext (either domain) → 2-component NTT ciphertext."""
    if not isinstance(plaintext, Plaintext) or plaintext.representation != "rns" or plaintext.data is None:
        raise FheliumValueError("encrypt needs an rns Plaintext from CkksEngine.encode")
    if not isinstance(public_key, PublicKey) or public_key.prime_ids != tuple(range(len(engine.moduli))):
        raise ParameterMismatchError("encrypt needs a PublicKey from this engine's generate_public_key")
    ids = plaintext.prime_ids
    if ids != engine.q_ids_at(plaintext.depth):
        raise PrimeMismatchError(f"plaintext prime_ids {list(ids)} do not match depth {plaintext.depth}")
    domain = plaintext.polynomial_domain
    if domain is None:
        raise FheliumValueError("encrypt needs a Plaintext in the coefficient or the NTT domain")
    data = public_encrypt(engine, plaintext.data, domain, None, ids, public_key)
    return Ciphertext(data, plaintext.depth, plaintext.scale, ids, "ntt")


def encrypt_integers(
    engine: EngineOperations,
    integers: torch.Tensor,
    public_key: PublicKey,
    *,
    scale: float,
    multiplier: int = 1,
    depth: int = 0,
    c0_noise: Callable[[int], torch.Tensor] | None = None,
) -> Ciphertext:
    """Public-key encryption of the coefficient-domain message ``integers · multiplier``.

    ``integers``: int64 ``[*batch, N]`` with |x| < 2^62 (every Q prime above 2^28); the
    multiplier is applied modulo each prime, so the message may exceed 2^62 (fhelium.multiparty
    encodes at 2^44 and multiplies by 2^44). The same ciphertext, bit for bit and from the same
    draws, as ``encrypt`` of the Plaintext holding those residues; on the native path the
    residues are taken inside ModDown instead of in a tensor of their own.

    ``c0_noise(rows)``, called once per group of batch rows in order, returns signed integers
    ``[rows, N]`` (|x| < 2^62) added to c0 alone in the coefficient domain: c0 + NTT(noise)
    exactly, without a transform of its own (it rides in ModDown's forward NTT with e0).
    fhelium.multiparty puts a party's flooding noise there (``ThresholdParty.encrypt_flooded``).
    """
    if not isinstance(public_key, PublicKey) or public_key.prime_ids != tuple(range(len(engine.moduli))):
        raise ParameterMismatchError("encrypt needs a PublicKey from this engine's generate_public_key")
    integers = torch.as_tensor(integers)
    if integers.dtype != torch.int64 or integers.ndim < 1 or integers.size(-1) != engine.ring_degree:
        raise FheliumValueError(f"encrypt_integers needs int64 [*batch, {engine.ring_degree}] integers")
    ids = engine.q_ids_at(depth)
    moduli = engine.moduli_for(ids)
    if min(moduli) <= 1 << 28:
        raise FheliumValueError("encrypt_integers needs every Q prime above 2^28")
    if integers.numel():
        low, high = (int(bound) for bound in torch.aminmax(integers))
        if max(-low, high) >= 1 << 62:
            raise FheliumValueError("encrypt_integers needs |integers| < 2^62")
    factors = torch.tensor([[multiplier % q for q in moduli]], dtype=torch.int64, device=engine.device)
    integers = integers.to(engine.device)
    data = public_encrypt(engine, integers.unsqueeze(-2), "coefficient", factors, ids, public_key, c0_noise)
    return Ciphertext(data, depth, float(scale), ids, "ntt")


def public_encrypt(
    engine: EngineOperations,
    message: torch.Tensor,
    domain: PolynomialDomain,
    factors: torch.Tensor | None,
    ids: tuple[int, ...],
    public_key: PublicKey,
    c0_noise: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ciphertext data ``[2, *batch, L, N]`` of ``message`` (residues ``[*batch, L, N]`` in
    ``domain``, or with ``factors [R, L]`` R rows of signed integers ``[*batch, R, N]``, row r
    times ``factors[r]``, summed).
    """
    batch = tuple(message.shape[:-2])
    groups = engine._batch_groups(batch, len(ids), sampled=True)
    if groups is not None:
        flat = message.reshape(math.prod(batch), *message.shape[-2:])
        data: torch.Tensor | None = None
        for g in groups:  # each part written into the output while it is still in cache
            part = public_encrypt(engine, flat[g], domain, factors, ids, public_key, c0_noise)
            if data is None:
                data = part.new_empty(part.size(0), flat.size(0), *part.shape[-2:])
            data[:, g] = part
        assert data is not None
        return data.view(data.size(0), *batch, *data.shape[-2:])
    qp_ids = (*ids, engine.special_prime_id)
    m = engine._mod(qp_ids)
    u = engine.random.stream("ephemeral").ternary((*batch, engine.ring_degree)).to(engine.device)
    errors = (
        engine.random.stream("error")
        .gaussian((2, *batch, engine.ring_degree), ERROR_STANDARD_DEVIATION)
        .to(engine.device)
    )
    # Only u needs a QP transform. e1 must be divided by P with c1 (it is multiplied by s at
    # decryption): it is added in ModDown's coefficient-domain steps, which is exactly
    # dividing pk1·u + e1 (saves 6 of 24 row transforms). e0 and a coefficient-domain
    # message are not divided; they ride along in ModDown's forward NTT.
    u_ntt = engine._small_ntt(u, qp_ids)
    keys = public_key.data[:, list(qp_ids)]
    products = mod.mul_mod(
        keys.view(2, *([1] * len(batch)), len(qp_ids), engine.ring_degree), u_ntt, m.q, m.q_inverse
    )
    q = engine._mod(ids)
    addend = engine._small_to_rns(errors[0], ids)
    native = engine.ntt.native_level != "torch"
    if c0_noise is not None:  # one more message row, factor 1 (encrypt_integers passes factors)
        assert factors is not None
        noise = c0_noise(math.prod(batch)).to(engine.device).view(*batch, 1, engine.ring_degree)
        message = torch.cat((message, noise), dim=-2)
        factors = torch.cat((factors, torch.ones_like(factors[:1])))
    divided = torch.stack((torch.zeros_like(errors[1]), errors[1])).long().unsqueeze(-2)
    if factors is None and domain == "coefficient":
        mod.add_mod_(addend, message, q.q)
    if native:
        # the addend (and a message with factors) go into c0 only; the message's residues are
        # taken and multiplied inside ModDown
        data = _native.mod_down(
            products,
            addend,
            divided,
            *engine.ntt._native_tables(qp_ids),
            engine.ntt.native_level,
            message=message if factors is not None else None,
            message_factors=factors,
        )
    else:
        if factors is not None:  # the reference: the residues, added as a coefficient-domain message
            for row in range(factors.size(0)):
                residues = mod.reduce_signed(message[..., row : row + 1, :], q.q)
                residues = mod.mul_mod(residues, factors[row].view(-1, 1), q.q, q.q_inverse)
                mod.add_mod_(addend, residues, q.q)
        data = engine._mod_down(products, ids, torch.stack((addend, torch.zeros_like(addend))), divided)
    if domain == "ntt":
        mod.add_mod_(data[0], message, q.q)
    return data


def encode_encrypt(
    engine: EngineOperations,
    values: torch.Tensor | Sequence[complex] | float,
    public_key: PublicKey,
    *,
    depth: int = 0,
    scale: float | None = None,
) -> Ciphertext:
    # a coefficient-domain plaintext skips the encoder's NTT: encrypt folds it into ModDown
    return engine.encrypt(engine.encode(values, depth=depth, scale=scale, domain="coefficient"), public_key)


def encrypt_symmetric(
    engine: EngineOperations, plaintext: Plaintext, secret: SecretKey, *, seed: bytes | None = None
) -> Ciphertext:
    """Secret-key encryption with c1 = a expanded from ``seed`` (see ``uniform_from_seed``)."""
    engine._check_secret(secret)
    if not isinstance(plaintext, Plaintext) or plaintext.representation != "rns" or plaintext.data is None:
        raise FheliumValueError("encrypt_symmetric needs an rns Plaintext from CkksEngine.encode")
    if plaintext.polynomial_domain != "ntt":
        raise ValueStateError("encrypt_symmetric needs an NTT-domain plaintext")
    ids = plaintext.prime_ids
    m = engine._mod(ids)
    batch = plaintext.batch_shape
    a = engine.uniform_from_seed(seed if seed is not None else RandomSource().seed, ids, batch)
    e = engine._error_ntt(batch, ids)
    s = secret.data[list(ids)]
    c0 = mod.add_mod(mod.sub_mod(e, mod.mul_mod(a, s, m.q, m.q_inverse), m.q), plaintext.data, m.q)
    return Ciphertext(torch.stack((c0, a)), plaintext.depth, plaintext.scale, ids, "ntt")


def encrypt_seeded(engine: EngineOperations, plaintext: Plaintext, secret: SecretKey) -> SeededCiphertext:
    """Secret-key encryption stored as (c0, seed): about half the bytes of a Ciphertext."""
    seed = RandomSource().seed
    ct = engine.encrypt_symmetric(plaintext, secret, seed=seed)
    return SeededCiphertext(ct.data[0].clone(), seed, ct.depth, ct.scale, ct.prime_ids, "ntt")


def expand_seeded(engine: EngineOperations, value: SeededCiphertext) -> Ciphertext:
    """Re-create c1 from the seed; the result is the full fresh Ciphertext."""
    if not isinstance(value, SeededCiphertext):
        raise FheliumValueError(f"expand_seeded needs a SeededCiphertext; got {type(value).__name__}")
    if value.ring_dimension != engine.ring_degree:
        raise ParameterMismatchError(
            f"SeededCiphertext has ring dimension {value.ring_dimension}; this engine uses "
            f"N={engine.ring_degree}"
        )
    a = engine.uniform_from_seed(value.seed, value.prime_ids, value.batch_shape).to(value.c0.device)
    return Ciphertext(torch.stack((value.c0, a)), value.depth, value.scale, value.prime_ids, "ntt")


def uniform_from_seed(
    engine: EngineOperations, seed: bytes, prime_ids: Sequence[int], batch_shape: Sequence[int]
) -> torch.Tensor:
    """The NTT-domain uniform polynomial(s) a seed expands to (deterministic)."""
    return (
        RandomSource(seed, purpose="seeded_uniform")
        .uniform_below(engine._mod(prime_ids).q.cpu(), (*batch_shape, len(prime_ids), engine.ring_degree))
        .to(engine.device)
    )


def decrypt(engine: EngineOperations, ciphertext: Ciphertext, secret: SecretKey) -> Plaintext:
    """→ ``approximate_coefficients`` Plaintext (float64 ``[*batch, N]``, not divided by the scale)."""
    ct = engine._check_ciphertext(ciphertext, "ciphertext")
    engine._check_secret(secret)
    groups = engine._batch_groups(ct.batch_shape, 2)
    if groups is not None:
        parts = [engine.decrypt(engine._ciphertext_part(ct, g), secret).tensor for g in groups]
        coefficients = torch.cat(parts).view(*ct.batch_shape, engine.ring_degree)
        return Plaintext(None, ct.depth, ct.scale, coefficients, "approximate_coefficients")
    ids = ct.prime_ids[-2:]
    data = ct.data[..., -len(ids) :, :]
    if ct.polynomial_domain == "coefficient":
        data = engine.ntt.forward(data, ids)
    m = engine._mod(ids)
    s = secret.data[list(ids)]
    phase = data[0].clone()
    power = s
    for component in range(1, ct.component_count):
        mod.add_mod_(phase, mod.mul_mod(data[component], power, m.q, m.q_inverse), m.q)
        if component + 1 < ct.component_count:
            power = mod.mul_mod(power, s, m.q, m.q_inverse)
    coefficients = engine._reconstruct(engine.ntt.inverse(phase, ids), ids)
    return Plaintext(None, ct.depth, ct.scale, coefficients.cpu(), "approximate_coefficients")


def decrypt_decode(engine: EngineOperations, ciphertext: Ciphertext, secret: SecretKey) -> torch.Tensor:
    return engine.decode(engine.decrypt(ciphertext, secret))
