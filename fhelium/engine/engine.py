"""CkksEngine: RNS-CKKS arithmetic on pure torch tensors.

State is explicit: operations check their operands' depth, scale, domain and primes and never
insert hidden rescales or domain changes. Ciphertexts are kept in the NTT domain by default
(``encrypt`` output), where add and multiply are pointwise; rescale and key switching do their
own internal transforms. Residues are always in the standard form ``[0, q)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium import native as _native
from fhelium.core import (
    Ciphertext,
    ConjugationKey,
    FheliumValueError,
    KeySwitchKey,
    MaximumDepthError,
    MissingKeyError,
    ParameterMismatchError,
    Plaintext,
    PolynomialDomain,
    PrimeMismatchError,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
    SeededCiphertext,
    ValueStateError,
    canonical_rotation_step,
)
from fhelium.engine.base import EngineBase
from fhelium.engine.compiled import compile_kernel
from fhelium.engine.keyset import KeySet
from fhelium.engine.parameters import ERROR_STANDARD_DEVIATION
from fhelium.engine.sampling import RandomSource

# Ciphertext rows switched per group in batched key switching (see _key_switch).
KEY_SWITCH_BLOCK_RESIDUES = 1 << 17
# Coefficients of an encoded message must stay well inside int64.
_MAX_ENCODED_MAGNITUDE = 2.0**62


@functools.lru_cache(maxsize=256)
def _index_tensor(ids: tuple[int, ...]) -> torch.Tensor:
    """The prime (or key digit / key row) ids as an int64 CPU tensor, for the native ops."""
    return torch.tensor(ids, dtype=torch.int64)


@functools.cache
def _compiled_inner_product() -> Callable[..., torch.Tensor]:
    """``modular.digit_inner_product`` through torch.compile (opt-in, once per process)."""
    return compile_kernel(mod.digit_inner_product)


class CkksEngine(EngineBase):
    """Keys, encoding, encryption and homomorphic operations for one parameter set."""

    # ------------------------------------------------------------------ keys
    def generate_secret_key(self) -> SecretKey:
        ids = tuple(range(len(self.moduli)))
        s = self.random.stream("secret").ternary((self.ring_degree,)).to(self.device)
        return SecretKey(self._small_ntt(s, ids), ids)

    def _small_ntt(self, values: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """Small signed integers ``[..., N]`` → NTT residues ``[..., rows, N]`` (one native call on CPU)."""
        if self.ntt.native_level != "torch":
            return _native.small_ntt(values, *self.ntt._native_tables(prime_ids), self.ntt.native_level)
        return self.ntt.forward(self._small_to_rns(values, prime_ids), prime_ids)

    def _check_secret(self, secret: object) -> SecretKey:
        if not isinstance(secret, SecretKey) or secret.prime_ids != tuple(range(len(self.moduli))):
            raise ParameterMismatchError(
                "expected a SecretKey from this engine's generate_secret_key (all QP primes)"
            )
        return secret

    def _error_ntt(self, shape: Sequence[int], prime_ids: Sequence[int]) -> torch.Tensor:
        e = self.random.stream("error").gaussian((*shape, self.ring_degree), ERROR_STANDARD_DEVIATION)
        return self._small_ntt(e.to(self.device), prime_ids)

    def generate_public_key(self, secret: SecretKey) -> PublicKey:
        """(−a·s + e, a) over Q and P: encrypting in QP and dividing by P (as SEAL does) shrinks the
        fresh-encryption noise from ‖e·u + e1·s‖ to the rounding error of that division.
        """
        self._check_secret(secret)
        ids = secret.prime_ids
        m = self._mod(ids)
        a = self.random.stream("uniform").uniform_below(m.q.cpu(), (len(ids), self.ring_degree))
        a = a.to(self.device)
        e = self._error_ntt((), ids)
        k0 = mod.sub_mod(e, mod.mul_mod(a, secret.data, m.q, m.q_inverse), m.q)
        return PublicKey(torch.stack((k0, a)), ids, modulus_basis="QP")

    def _key_switch_key_data(self, secret: SecretKey, source: torch.Tensor) -> torch.Tensor:
        """Digits j < q_count: (−a_j·s + e_j + [row j]·P·source, a_j) over all QP primes, NTT."""
        ids = tuple(range(len(self.moduli)))
        m = self._mod(ids)
        digits = self.q_count
        a = self.random.stream("uniform").uniform_below(m.q.cpu(), (digits, len(ids), self.ring_degree))
        a = a.to(self.device)
        e = self._error_ntt((digits,), ids)
        k0 = mod.sub_mod(e, mod.mul_mod(a, secret.data, m.q, m.q_inverse), m.q)
        special = self.moduli[self.special_prime_id]
        for j in range(digits):
            q_j = self.moduli[j]
            factor = torch.full_like(source[j], special % q_j)
            gadget = mod.mul_mod(source[j], factor, m.q[j], m.q_inverse[j])
            k0[j, j] = mod.add_mod(k0[j, j], gadget, m.q[j])
        return torch.stack((k0, a), dim=1)

    def generate_relinearization_key(self, secret: SecretKey) -> RelinearizationKey:
        self._check_secret(secret)
        m = self._mod(secret.prime_ids)
        square = mod.mul_mod(secret.data, secret.data, m.q, m.q_inverse)
        return RelinearizationKey(self._key_switch_key_data(secret, square), secret.prime_ids)

    def generate_rotation_key(self, secret: SecretKey, step: int) -> RotationKey:
        self._check_secret(secret)
        step = canonical_rotation_step(step, self.slot_count)
        element = self.encoder.rotation_galois_element(step)
        rotated = self._apply_galois(secret.data, element, "ntt")
        return RotationKey(self._key_switch_key_data(secret, rotated), secret.prime_ids, rotation_step=step)

    def generate_conjugation_key(self, secret: SecretKey) -> ConjugationKey:
        self._check_secret(secret)
        conjugated = self._apply_galois(secret.data, self.encoder.conjugation_galois_element, "ntt")
        return ConjugationKey(self._key_switch_key_data(secret, conjugated), secret.prime_ids)

    def generate_keys(
        self, *, relinearization: bool = True, rotation_steps: Iterable[int] = (), conjugation: bool = False
    ) -> KeySet:
        secret = self.generate_secret_key()
        keys = KeySet(secret, self.generate_public_key(secret))
        if relinearization:
            keys.relinearization = self.generate_relinearization_key(secret)
        for step in rotation_steps:
            keys.rotations[step] = self.generate_rotation_key(secret, step)
        if conjugation:
            keys.conjugation = self.generate_conjugation_key(secret)
        return keys

    # ------------------------------------------------------------------ encode / decode
    def encode(
        self,
        values: torch.Tensor | Sequence[complex] | float,
        *,
        depth: int = 0,
        scale: float | None = None,
        domain: PolynomialDomain = "ntt",
    ) -> Plaintext:
        """Slots ``[*batch, ≤S]`` (real or complex; a scalar fills every slot) → rns Plaintext."""
        scale = self.default_scale if scale is None else float(scale)
        ids = self.q_ids_at(depth)
        message = torch.as_tensor(values).cpu()
        if message.ndim == 0:
            message = message.expand(self.slot_count)
        if message.size(-1) > self.slot_count:
            raise FheliumValueError(
                f"encode got {message.size(-1)} slots; this engine has {self.slot_count} (N/2)"
            )
        if message.size(-1) < self.slot_count:
            pad = torch.zeros(*message.shape[:-1], self.slot_count - message.size(-1), dtype=message.dtype)
            message = torch.cat((message, pad), dim=-1)
        coefficients = self.encoder.slots_to_coefficients(message.cpu()) * scale
        largest = float(coefficients.abs().max()) if coefficients.numel() else 0.0
        if not math.isfinite(largest) or largest >= _MAX_ENCODED_MAGNITUDE:
            raise FheliumValueError(
                f"encoded coefficients reach {largest:.3g}, beyond 2^62: the message is too large for "
                f"scale {scale!r} (reduce the scale or the values)"
            )
        integers = coefficients.round().long().to(self.device)
        residues = torch.remainder(integers.unsqueeze(-2), self._mod(ids).q)
        if domain == "ntt":
            residues = self.ntt.forward(residues, ids)
        return Plaintext(None, depth, scale, residues, "rns", domain, "Q", "standard", ids)

    def _reconstruct(self, residues: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """Centered float64 value from the trailing one or two coefficient-domain rows."""
        if len(prime_ids) == 1:
            q = self._mod(prime_ids).q
            return mod.center(residues[..., 0, :], q[0]).double()
        q1, q2 = self.moduli_for(prime_ids[-2:])
        x1 = residues[..., -2, :]
        x2 = residues[..., -1, :]
        q1_t = torch.tensor(q1, dtype=torch.int64, device=residues.device)
        q2_t = torch.tensor(q2, dtype=torch.int64, device=residues.device)
        inverse = torch.full_like(x1, pow(q1, -1, q2))
        difference = mod.sub_mod(x2, torch.remainder(x1, q2_t), q2_t)
        k = mod.center(mod.mul_mod(difference, inverse, q2_t, 1.0 / q2_t.double()), q2_t)
        return x1.double() + float(q1_t) * k.double()

    def decode(self, plaintext: Plaintext) -> torch.Tensor:
        """An rns or approximate-coefficient Plaintext → complex128 slots ``[*batch, S]`` on CPU."""
        if not isinstance(plaintext, Plaintext) or plaintext.data is None:
            raise FheliumValueError("decode needs a Plaintext with coefficient data (rns or approximate)")
        if plaintext.representation == "approximate_coefficients":
            coefficients = plaintext.data
        elif plaintext.representation == "rns":
            data = plaintext.data
            if plaintext.polynomial_domain == "ntt":
                data = self.ntt.inverse(data[..., -2:, :], plaintext.prime_ids[-2:])
            coefficients = self._reconstruct(data, plaintext.prime_ids[-2:])
        else:
            raise FheliumValueError(f"decode cannot read a {plaintext.representation!r} Plaintext")
        return self.encoder.coefficients_to_slots(coefficients.cpu() / plaintext.scale)

    # ------------------------------------------------------------------ encrypt / decrypt
    def encrypt(self, plaintext: Plaintext, public_key: PublicKey) -> Ciphertext:
        """Public-key encryption of an rns Plaintext (either domain) → 2-component NTT ciphertext."""
        if (
            not isinstance(plaintext, Plaintext)
            or plaintext.representation != "rns"
            or plaintext.data is None
        ):
            raise FheliumValueError("encrypt needs an rns Plaintext from CkksEngine.encode")
        if not isinstance(public_key, PublicKey) or public_key.prime_ids != tuple(range(len(self.moduli))):
            raise ParameterMismatchError("encrypt needs a PublicKey from this engine's generate_public_key")
        ids = plaintext.prime_ids
        if ids != self.q_ids_at(plaintext.depth):
            raise PrimeMismatchError(f"plaintext prime_ids {list(ids)} do not match depth {plaintext.depth}")
        domain = plaintext.polynomial_domain
        if domain is None:
            raise FheliumValueError("encrypt needs a Plaintext in the coefficient or the NTT domain")
        data = self._public_encrypt(plaintext.data, domain, None, ids, public_key)
        return Ciphertext(data, plaintext.depth, plaintext.scale, ids, "ntt")

    def encrypt_integers(
        self,
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
        if not isinstance(public_key, PublicKey) or public_key.prime_ids != tuple(range(len(self.moduli))):
            raise ParameterMismatchError("encrypt needs a PublicKey from this engine's generate_public_key")
        integers = torch.as_tensor(integers)
        if integers.dtype != torch.int64 or integers.ndim < 1 or integers.size(-1) != self.ring_degree:
            raise FheliumValueError(f"encrypt_integers needs int64 [*batch, {self.ring_degree}] integers")
        ids = self.q_ids_at(depth)
        moduli = self.moduli_for(ids)
        if min(moduli) <= 1 << 28:
            raise FheliumValueError("encrypt_integers needs every Q prime above 2^28")
        if integers.numel():
            low, high = (int(bound) for bound in torch.aminmax(integers))
            if max(-low, high) >= 1 << 62:
                raise FheliumValueError("encrypt_integers needs |integers| < 2^62")
        factors = torch.tensor([[multiplier % q for q in moduli]], dtype=torch.int64, device=self.device)
        integers = integers.to(self.device)
        data = self._public_encrypt(integers.unsqueeze(-2), "coefficient", factors, ids, public_key, c0_noise)
        return Ciphertext(data, depth, float(scale), ids, "ntt")

    def _public_encrypt(
        self,
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
        groups = self._batch_groups(batch, len(ids), sampled=True)
        if groups is not None:
            flat = message.reshape(math.prod(batch), *message.shape[-2:])
            data: torch.Tensor | None = None
            for g in groups:  # each part written into the output while it is still in cache
                part = self._public_encrypt(flat[g], domain, factors, ids, public_key, c0_noise)
                if data is None:
                    data = part.new_empty(part.size(0), flat.size(0), *part.shape[-2:])
                data[:, g] = part
            assert data is not None
            return data.view(data.size(0), *batch, *data.shape[-2:])
        qp_ids = (*ids, self.special_prime_id)
        m = self._mod(qp_ids)
        u = self.random.stream("ephemeral").ternary((*batch, self.ring_degree)).to(self.device)
        errors = (
            self.random.stream("error")
            .gaussian((2, *batch, self.ring_degree), ERROR_STANDARD_DEVIATION)
            .to(self.device)
        )
        # Only u needs a QP transform. e1 must be divided by P with c1 (it is multiplied by s at
        # decryption): it is added in ModDown's coefficient-domain steps, which is exactly
        # dividing pk1·u + e1 (saves 6 of 24 row transforms). e0 and a coefficient-domain
        # message are not divided; they ride along in ModDown's forward NTT.
        u_ntt = self._small_ntt(u, qp_ids)
        keys = public_key.data[:, list(qp_ids)]
        products = mod.mul_mod(
            keys.view(2, *([1] * len(batch)), len(qp_ids), self.ring_degree), u_ntt, m.q, m.q_inverse
        )
        q = self._mod(ids)
        addend = self._small_to_rns(errors[0], ids)
        native = self.ntt.native_level != "torch"
        if c0_noise is not None:  # one more message row, factor 1 (encrypt_integers passes factors)
            assert factors is not None
            noise = c0_noise(math.prod(batch)).to(self.device).view(*batch, 1, self.ring_degree)
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
                *self.ntt._native_tables(qp_ids),
                self.ntt.native_level,
                message=message if factors is not None else None,
                message_factors=factors,
            )
        else:
            if factors is not None:  # the reference: the residues, added as a coefficient-domain message
                for row in range(factors.size(0)):
                    residues = mod.reduce_signed(message[..., row : row + 1, :], q.q)
                    residues = mod.mul_mod(residues, factors[row].view(-1, 1), q.q, q.q_inverse)
                    mod.add_mod_(addend, residues, q.q)
            data = self._mod_down(products, ids, torch.stack((addend, torch.zeros_like(addend))), divided)
        if domain == "ntt":
            mod.add_mod_(data[0], message, q.q)
        return data

    def encode_encrypt(
        self,
        values: torch.Tensor | Sequence[complex] | float,
        public_key: PublicKey,
        *,
        depth: int = 0,
        scale: float | None = None,
    ) -> Ciphertext:
        # a coefficient-domain plaintext skips the encoder's NTT: encrypt folds it into ModDown
        return self.encrypt(self.encode(values, depth=depth, scale=scale, domain="coefficient"), public_key)

    def encrypt_symmetric(
        self, plaintext: Plaintext, secret: SecretKey, *, seed: bytes | None = None
    ) -> Ciphertext:
        """Secret-key encryption with c1 = a expanded from ``seed`` (see ``uniform_from_seed``)."""
        self._check_secret(secret)
        if (
            not isinstance(plaintext, Plaintext)
            or plaintext.representation != "rns"
            or plaintext.data is None
        ):
            raise FheliumValueError("encrypt_symmetric needs an rns Plaintext from CkksEngine.encode")
        if plaintext.polynomial_domain != "ntt":
            raise ValueStateError("encrypt_symmetric needs an NTT-domain plaintext")
        ids = plaintext.prime_ids
        m = self._mod(ids)
        batch = plaintext.batch_shape
        a = self.uniform_from_seed(seed if seed is not None else RandomSource().seed, ids, batch)
        e = self._error_ntt(batch, ids)
        s = secret.data[list(ids)]
        c0 = mod.add_mod(mod.sub_mod(e, mod.mul_mod(a, s, m.q, m.q_inverse), m.q), plaintext.data, m.q)
        return Ciphertext(torch.stack((c0, a)), plaintext.depth, plaintext.scale, ids, "ntt")

    def encrypt_seeded(self, plaintext: Plaintext, secret: SecretKey) -> SeededCiphertext:
        """Secret-key encryption stored as (c0, seed): about half the bytes of a Ciphertext."""
        seed = RandomSource().seed
        ct = self.encrypt_symmetric(plaintext, secret, seed=seed)
        return SeededCiphertext(ct.data[0].clone(), seed, ct.depth, ct.scale, ct.prime_ids, "ntt")

    def expand_seeded(self, value: SeededCiphertext) -> Ciphertext:
        """Re-create c1 from the seed; the result is the full fresh Ciphertext."""
        if not isinstance(value, SeededCiphertext):
            raise FheliumValueError(f"expand_seeded needs a SeededCiphertext; got {type(value).__name__}")
        if value.ring_dimension != self.ring_degree:
            raise ParameterMismatchError(
                f"SeededCiphertext has ring dimension {value.ring_dimension}; this engine uses "
                f"N={self.ring_degree}"
            )
        a = self.uniform_from_seed(value.seed, value.prime_ids, value.batch_shape).to(value.c0.device)
        return Ciphertext(torch.stack((value.c0, a)), value.depth, value.scale, value.prime_ids, "ntt")

    def uniform_from_seed(
        self, seed: bytes, prime_ids: Sequence[int], batch_shape: Sequence[int]
    ) -> torch.Tensor:
        """The NTT-domain uniform polynomial(s) a seed expands to (deterministic)."""
        return (
            RandomSource(seed, purpose="seeded_uniform")
            .uniform_below(self._mod(prime_ids).q.cpu(), (*batch_shape, len(prime_ids), self.ring_degree))
            .to(self.device)
        )

    def decrypt(self, ciphertext: Ciphertext, secret: SecretKey) -> Plaintext:
        """→ ``approximate_coefficients`` Plaintext (float64 ``[*batch, N]``, not divided by the scale)."""
        ct = self._check_ciphertext(ciphertext, "ciphertext")
        self._check_secret(secret)
        groups = self._batch_groups(ct.batch_shape, 2)
        if groups is not None:
            parts = [self.decrypt(self._ciphertext_part(ct, g), secret).tensor for g in groups]
            coefficients = torch.cat(parts).view(*ct.batch_shape, self.ring_degree)
            return Plaintext(None, ct.depth, ct.scale, coefficients, "approximate_coefficients")
        ids = ct.prime_ids[-2:]
        data = ct.data[..., -len(ids) :, :]
        if ct.polynomial_domain == "coefficient":
            data = self.ntt.forward(data, ids)
        m = self._mod(ids)
        s = secret.data[list(ids)]
        phase = data[0].clone()
        power = s
        for component in range(1, ct.component_count):
            mod.add_mod_(phase, mod.mul_mod(data[component], power, m.q, m.q_inverse), m.q)
            if component + 1 < ct.component_count:
                power = mod.mul_mod(power, s, m.q, m.q_inverse)
        coefficients = self._reconstruct(self.ntt.inverse(phase, ids), ids)
        return Plaintext(None, ct.depth, ct.scale, coefficients.cpu(), "approximate_coefficients")

    def decrypt_decode(self, ciphertext: Ciphertext, secret: SecretKey) -> torch.Tensor:
        return self.decode(self.decrypt(ciphertext, secret))

    # ------------------------------------------------------------------ additive operations
    def add(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        self._check_pair(lhs, rhs, "add")
        return lhs.with_data(mod.add_mod(lhs.data, rhs.data, self._mod(lhs.prime_ids).q))

    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        """In place: ``lhs += rhs`` in lhs's storage (also through a ``slice_limbs`` view); returns lhs."""
        self._check_pair(lhs, rhs, "add_")
        mod.add_mod_(lhs.data, rhs.data, self._mod(lhs.prime_ids).q)
        return lhs

    def sub(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        self._check_pair(lhs, rhs, "sub")
        return lhs.with_data(mod.sub_mod(lhs.data, rhs.data, self._mod(lhs.prime_ids).q))

    def sub_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        self._check_pair(lhs, rhs, "sub_")
        mod.sub_mod_(lhs.data, rhs.data, self._mod(lhs.prime_ids).q)
        return lhs

    def negate(self, value: Ciphertext) -> Ciphertext:
        self._check_ciphertext(value, "value")
        return value.with_data(mod.neg_mod(value.data, self._mod(value.prime_ids).q))

    def negate_(self, value: Ciphertext) -> Ciphertext:
        self._check_ciphertext(value, "value")
        value.data.copy_(mod.neg_mod(value.data, self._mod(value.prime_ids).q))
        return value

    def sum(self, values: Sequence[Ciphertext]) -> Ciphertext:
        if not values:
            raise FheliumValueError("sum needs at least one ciphertext")
        total = values[0].clone()
        for value in values[1:]:
            self.add_(total, value)
        return total

    def sum_batch(self, value: Ciphertext, dim: int = 0) -> Ciphertext:
        """Modular sum over batch axis ``dim``; the result drops that axis."""
        self._check_ciphertext(value, "value")
        if not 0 <= dim < len(value.batch_shape):
            raise FheliumValueError(f"sum_batch dim must be in [0, {len(value.batch_shape)}); got {dim}")
        q = self._mod(value.prime_ids).q
        axis = 1 + dim
        # int64 holds a sum of up to 2**13 residues below 2**50; fold in chunks beyond that
        chunks = torch.split(value.data, 1 << 13, dim=axis)
        total = torch.remainder(chunks[0].sum(dim=axis), q)
        for chunk in chunks[1:]:
            total = mod.add_mod(total, torch.remainder(chunk.sum(dim=axis), q), q)
        return value.with_data(total)

    # ------------------------------------------------------------------ plaintext operations
    def add_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        return self._with_plain_in_c0(ct, pt, "add_plain", mod.add_mod_)

    def sub_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        return self._with_plain_in_c0(ct, pt, "sub_plain", mod.sub_mod_)

    def _with_plain_in_c0(
        self, ct: Ciphertext, pt: Plaintext, operation: str, combine_: Callable[..., torch.Tensor]
    ) -> Ciphertext:
        """A copy of ``ct`` whose c0 is combined (in place, modularly) with the plaintext."""
        self._check_ciphertext(ct, "ciphertext")
        pt = self._check_plaintext(ct, pt, operation, same_scale=True)
        assert pt.data is not None
        data = ct.data.clone()
        combine_(data[0], pt.data, self._mod(ct.prime_ids).q)
        return ct.with_data(data)

    def multiply_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        """Pointwise product with an NTT plaintext; scales multiply (rescale afterwards)."""
        self._check_ciphertext(ct, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", name="multiply_plain ciphertext")
        pt = self._check_plaintext(ct, pt, "multiply_plain", same_scale=False)
        assert pt.data is not None
        groups = self._batch_groups(ct.batch_shape, ct.limb_count)
        if groups is not None and pt.batch_shape in ((), ct.batch_shape):
            parts = [
                self.multiply_plain(self._ciphertext_part(ct, g), self._plaintext_part(pt, g)) for g in groups
            ]
            return self._join(parts, ct.batch_shape)
        m = self._mod(ct.prime_ids)
        data = mod.mul_mod(ct.data, pt.data, m.q, m.q_inverse)
        return Ciphertext(data, ct.depth, ct.scale * pt.scale, ct.prime_ids, "ntt", ct.modulus_basis)

    # ------------------------------------------------------------------ multiplication
    def multiply(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        """(a0, a1)·(b0, b1) → (a0b0, a0b1 + a1b0, a1b1), NTT domain, scale lhs.scale·rhs.scale."""
        self._check_pair(lhs, rhs, "multiply", same_scale=False)
        for value, name in ((lhs, "lhs"), (rhs, "rhs")):
            value.assert_state(polynomial_domain="ntt", components=2, name=f"multiply {name}")
        groups = self._batch_groups(lhs.batch_shape, lhs.limb_count)
        if groups is not None:
            parts = [
                self.multiply(self._ciphertext_part(lhs, g), self._ciphertext_part(rhs, g)) for g in groups
            ]
            return self._join(parts, lhs.batch_shape)
        if self.ntt.native_level != "torch":  # one native pass, the same residues
            moduli = self.ntt._native_tables(lhs.prime_ids)[0]
            data = _native.tensor_product(lhs.data, rhs.data, moduli, self.ntt.native_level)
            return Ciphertext(data, lhs.depth, lhs.scale * rhs.scale, lhs.prime_ids, "ntt")
        m = self._mod(lhs.prime_ids)
        a0, a1 = lhs.data[0], lhs.data[1]
        b0, b1 = rhs.data[0], rhs.data[1]
        # Karatsuba: a0b1 + a1b0 = (a0+a1)(b0+b1) - a0b0 - a1b1 saves one product
        d0 = mod.mul_mod(a0, b0, m.q, m.q_inverse)
        d2 = mod.mul_mod(a1, b1, m.q, m.q_inverse)
        cross = mod.mul_mod(mod.add_mod(a0, a1, m.q), mod.add_mod(b0, b1, m.q), m.q, m.q_inverse)
        d1 = mod.sub_mod_(mod.sub_mod_(cross, d0, m.q), d2, m.q)
        return Ciphertext(torch.stack((d0, d1, d2)), lhs.depth, lhs.scale * rhs.scale, lhs.prime_ids, "ntt")

    def square(self, value: Ciphertext) -> Ciphertext:
        return self.multiply(value, value)

    def _check_switch_key(self, key: KeySwitchKey) -> None:
        if key.prime_ids != tuple(range(len(self.moduli))) or key.digit_count != self.q_count:
            raise ParameterMismatchError(
                f"{type(key).__name__} does not match this engine: expected {self.q_count} digits over prime "
                f"ids 0..{len(self.moduli) - 1}; got {key.digit_count} digits over {list(key.prime_ids)}"
            )

    def _decompose(self, poly_ntt: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
        """One digit per active Q prime (its centered residue), lifted to every QP prime, NTT.

        ``[*batch, L, N]`` → ``[L, *batch, L+1, N]``. Galois maps commute with this step, which is
        what lets ``rotate_many`` decompose once for many rotations.
        """
        qp_ids = (*ids, self.special_prime_id)
        if self.ntt.native_level != "torch":
            return _native.decompose(poly_ntt, *self.ntt._native_tables(qp_ids), self.ntt.native_level)
        coefficients = self.ntt.inverse(poly_ntt, ids)
        digits = mod.center(coefficients, self._mod(ids).q).movedim(-2, 0).unsqueeze(-2)
        return self.ntt.forward(torch.remainder(digits, self._mod(qp_ids).q), qp_ids)

    def _inner_product(self, lifted: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey) -> torch.Tensor:
        """Σ_j digit_j · key_j over QP, then ModDown: ``[2, *batch, L, N]`` in the NTT domain."""
        self._check_switch_key(key)
        qp_ids = (*ids, self.special_prime_id)
        if self.ntt.native_level != "torch":
            return _native.key_switch_lifted(
                lifted,
                key.data,
                _index_tensor(ids),
                _index_tensor(qp_ids),
                *self.ntt._native_tables(qp_ids),
                self.ntt.native_level,
            )
        qp_mod = self._mod(qp_ids)
        key_rows = key.data[list(ids)][:, :, list(qp_ids)]  # [L, 2, L+1, N]
        key_rows = key_rows.view(len(ids), 2, 1, len(qp_ids), self.ring_degree)
        kernel = _compiled_inner_product() if self.ntt.compiled else mod.digit_inner_product
        flat = lifted.reshape(len(ids), -1, len(qp_ids), self.ring_degree)  # one rank for every batch
        accumulated = kernel(flat, key_rows, qp_mod.q, qp_mod.q_inverse)
        return self._mod_down(accumulated.view(2, *lifted.shape[1:]), ids)

    def _key_switch(self, poly_ntt: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey) -> torch.Tensor:
        """Switch ``poly·s_src`` to (b0 + b1·s): returns ``[2, *batch, rows, N]`` in the NTT domain.

        Batches are switched a few ciphertexts at a time: the lifted digits are L+1 times the
        input, and keeping them cache-sized measured faster than one pass over a large batch.
        """
        self._check_switch_key(key)
        if self.ntt.native_level != "torch":  # the whole pipeline in one native call
            qp_ids = (*ids, self.special_prime_id)
            return _native.key_switch(
                poly_ntt,
                key.data,
                _index_tensor(ids),
                _index_tensor(qp_ids),
                *self.ntt._native_tables(qp_ids),
                self.ntt.native_level,
            )
        batch_shape = poly_ntt.shape[:-2]
        flat = poly_ntt.reshape(-1, *poly_ntt.shape[-2:])
        per_group = max(1, KEY_SWITCH_BLOCK_RESIDUES // (len(ids) * self.ring_degree))
        if flat.size(0) <= per_group:
            return self._inner_product(self._decompose(poly_ntt, ids), ids, key)
        parts = [
            self._inner_product(self._decompose(flat[start : start + per_group], ids), ids, key)
            for start in range(0, flat.size(0), per_group)
        ]
        return torch.cat(parts, dim=1).view(2, *batch_shape, len(ids), self.ring_degree)

    def _mod_down(
        self,
        values: torch.Tensor,
        ids: tuple[int, ...],
        addend: torch.Tensor | None = None,
        divided: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """NTT values over ``ids + (P,)`` → round((values + ``divided``) / P) (+ ``addend``) over
        ``ids``, NTT domain; neither extra term costs a transform.

        ``addend`` is a coefficient-domain residue tensor over ``ids``; it is folded into the one
        forward NTT ModDown needs anyway (as −P·addend, which the division by P turns into
        +addend). ``divided`` holds small signed coefficient-domain integers ``[..., 1, N]``: with
        v = values + divided, ModDown needs v's P row in the coefficient domain (INTT of values'
        P row, plus divided) and v_Q − NTT(lift) = values_Q − NTT(lift − divided).
        """
        special = self.special_prime_id
        if self.ntt.native_level != "torch":
            tables = self.ntt._native_tables((*ids, special))
            if addend is None and divided is None:
                return _native.divide_round(values, *tables, len(ids), ntt=True, level=self.ntt.native_level)
            if addend is not None:
                addend = addend.expand(*values.shape[:-2], len(ids), self.ring_degree)
            if divided is not None:
                divided = divided.expand(*values.shape[:-2], 1, self.ring_degree)
            return _native.mod_down(values, addend, divided, *tables, self.ntt.native_level)
        q_mod = self._mod(ids)
        p_q = self._mod((special,)).q
        p_row = self.ntt.inverse(values[..., -1:, :], (special,))
        if divided is not None:
            p_row = mod.correct(p_row + divided, p_q)  # |divided| << P: one correction each way
        lifted = torch.remainder(mod.center(p_row, p_q), q_mod.q)
        if divided is not None:
            lifted = mod.sub_mod(lifted, torch.remainder(divided, q_mod.q), q_mod.q)
        if addend is not None:
            p_residues = torch.remainder(
                torch.tensor(self.moduli[special], device=self.device), q_mod.q
            ).expand_as(addend)
            scaled = mod.mul_mod(addend, p_residues, q_mod.q, q_mod.q_inverse)
            lifted = mod.sub_mod(lifted, scaled, q_mod.q)
        correction = self.ntt.forward(lifted, ids)
        difference = mod.sub_mod(values[..., :-1, :], correction, q_mod.q)
        p_inverse, p_inverse_over_q = self._inverse_constants(self.moduli[special], ids)
        return mod.mul_mod_shoup(difference, p_inverse, p_inverse_over_q, q_mod.q)

    def _inverse_constants(self, value: int, ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (value, ids)
        cached = self._inverse_cache.get(key)
        if cached is None:
            q = self._mod(ids).q
            inverse = torch.tensor(
                [pow(value, -1, prime) for prime in self.moduli_for(ids)],
                dtype=torch.int64,
                device=self.device,
            ).unsqueeze(-1)
            cached = (inverse, inverse.double() / q.double())
            self._inverse_cache[key] = cached
        return cached

    def relinearize(self, value: Ciphertext, key: RelinearizationKey) -> Ciphertext:
        """3-component NTT ciphertext → 2 components, via key switching of the s² term."""
        ct = self._check_ciphertext(value, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", components=3, name="relinearize input")
        if not isinstance(key, RelinearizationKey):
            raise FheliumValueError(f"relinearize needs a RelinearizationKey; got {type(key).__name__}")
        ids = self._check_full_layout(ct, "ciphertext", "relinearize")
        groups = self._batch_groups(ct.batch_shape, ct.limb_count)
        if groups is not None:
            parts = [self.relinearize(self._ciphertext_part(ct, g), key) for g in groups]
            return self._join(parts, ct.batch_shape)
        switched = self._key_switch(ct.data[2], ids, key)
        q = self._mod(ids).q
        return ct.with_data(mod.add_mod(ct.data[:2], switched, q))

    def rescale(self, value: Ciphertext) -> Ciphertext:
        """Divide by the leading prime with rounding: depth + 1, scale / q_dropped."""
        ct = self._check_ciphertext(value, "ciphertext")
        ids = self._check_full_layout(ct, "ciphertext", "rescale")
        if len(ids) < 2:
            raise MaximumDepthError(
                f"rescale: ciphertext is at the last depth {ct.depth} (only the base prime is left)"
            )
        groups = self._batch_groups(ct.batch_shape, ct.limb_count)
        if groups is not None:
            return self._join([self.rescale(self._ciphertext_part(ct, g)) for g in groups], ct.batch_shape)
        dropped, rest = ids[0], ids[1:]
        q_drop = self.moduli[dropped]
        if self.ntt.native_level != "torch":
            data = _native.divide_round(
                ct.data,
                *self.ntt._native_tables(ids),
                0,
                ntt=ct.polynomial_domain == "ntt",
                level=self.ntt.native_level,
            )
            return Ciphertext(data, ct.depth + 1, ct.scale / q_drop, rest, ct.polynomial_domain)
        rest_mod = self._mod(rest)
        last = ct.data[..., :1, :]
        if ct.polynomial_domain == "ntt":
            last = self.ntt.inverse(last, (dropped,))
        centered = mod.center(last, self._mod((dropped,)).q)
        correction = torch.remainder(centered, rest_mod.q)
        if ct.polynomial_domain == "ntt":
            correction = self.ntt.forward(correction, rest)
        difference = mod.sub_mod(ct.data[..., 1:, :], correction, rest_mod.q)
        inverse, inverse_over_q = self._inverse_constants(q_drop, rest)
        data = mod.mul_mod_shoup(difference, inverse, inverse_over_q, rest_mod.q)
        return Ciphertext(data, ct.depth + 1, ct.scale / q_drop, rest, ct.polynomial_domain)

    def mod_switch(self, value: Ciphertext) -> Ciphertext:
        """Drop the leading prime without dividing: depth + 1, same scale (to align depths)."""
        ct = self._check_ciphertext(value, "ciphertext")
        ids = self._check_full_layout(ct, "ciphertext", "mod_switch")
        if len(ids) < 2:
            raise MaximumDepthError(f"mod_switch: ciphertext is at the last depth {ct.depth}")
        return Ciphertext(
            ct.data[..., 1:, :].contiguous(), ct.depth + 1, ct.scale, ids[1:], ct.polynomial_domain
        )

    def mod_switch_plain(self, pt: Plaintext) -> Plaintext:
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

    # ------------------------------------------------------------------ domains
    def to_ntt(self, value: Ciphertext) -> Ciphertext:
        ct = self._check_ciphertext(value, "ciphertext")
        ct.assert_state(polynomial_domain="coefficient", name="to_ntt input")
        data = self.ntt.forward(ct.data, ct.prime_ids)
        return Ciphertext(data, ct.depth, ct.scale, ct.prime_ids, "ntt", ct.modulus_basis)

    def to_coefficient(self, value: Ciphertext) -> Ciphertext:
        ct = self._check_ciphertext(value, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", name="to_coefficient input")
        data = self.ntt.inverse(ct.data, ct.prime_ids)
        return Ciphertext(data, ct.depth, ct.scale, ct.prime_ids, "coefficient", ct.modulus_basis)

    # ------------------------------------------------------------------ rotations
    def _galois_switch(
        self, value: Ciphertext, element: int, key: KeySwitchKey, operation: str
    ) -> Ciphertext:
        ct = self._check_ciphertext(value, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", components=2, name=f"{operation} input")
        ids = self._check_full_layout(ct, "ciphertext", operation)
        groups = self._batch_groups(ct.batch_shape, ct.limb_count)
        if groups is not None:
            parts = [
                self._galois_switch(self._ciphertext_part(ct, g), element, key, operation) for g in groups
            ]
            return self._join(parts, ct.batch_shape)
        permuted = self._apply_galois(ct.data, element, "ntt")
        switched = self._key_switch(permuted[1], ids, key)
        q = self._mod(ids).q
        mod.add_mod_(switched[0], permuted[0], q)
        return ct.with_data(switched)

    def rotate(self, value: Ciphertext, key: RotationKey) -> Ciphertext:
        """Slots m → ``torch.roll(m, key.rotation_step)``."""
        if not isinstance(key, RotationKey):
            raise FheliumValueError(f"rotate needs a RotationKey; got {type(key).__name__}")
        element = self.encoder.rotation_galois_element(key.rotation_step)
        return self._galois_switch(value, element, key, "rotate")

    def rotate_many(self, value: Ciphertext, keys: Sequence[RotationKey]) -> list[Ciphertext]:
        """Several rotations of one ciphertext sharing one digit decomposition (hoisting).

        Bit-identical to calling ``rotate`` per key; saves the decomposition's L·(L+1) row NTTs
        for every rotation after the first.
        """
        ct = self._check_ciphertext(value, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", components=2, name="rotate_many input")
        ids = self._check_full_layout(ct, "ciphertext", "rotate_many")
        for key in keys:
            if not isinstance(key, RotationKey):
                raise FheliumValueError(f"rotate_many needs RotationKeys; got {type(key).__name__}")
        lifted = self._decompose(ct.data[1], ids)
        q = self._mod(ids).q
        results = []
        for key in keys:
            element = self.encoder.rotation_galois_element(key.rotation_step)
            switched = self._inner_product(self._apply_galois(lifted, element, "ntt"), ids, key)
            mod.add_mod_(switched[0], self._apply_galois(ct.data[0], element, "ntt"), q)
            results.append(ct.with_data(switched))
        return results

    def rotate_by_step(
        self, value: Ciphertext, step: int, keys: KeySet | Mapping[int, RotationKey]
    ) -> Ciphertext:
        """Rotate by ``step`` slots using the matching key from a KeySet or a step → key mapping."""
        if isinstance(keys, KeySet):
            return self.rotate(value, keys.rotation(step))
        canonical = canonical_rotation_step(step, self.slot_count)
        for key in keys.values():
            if key.rotation_step == canonical:
                return self.rotate(value, key)
        raise MissingKeyError(f"no rotation key for step {step} (canonical {canonical}) among {sorted(keys)}")

    def conjugate(self, value: Ciphertext, key: ConjugationKey) -> Ciphertext:
        """Complex-conjugate every slot."""
        if not isinstance(key, ConjugationKey):
            raise FheliumValueError(f"conjugate needs a ConjugationKey; got {type(key).__name__}")
        return self._galois_switch(value, self.encoder.conjugation_galois_element, key, "conjugate")


__all__ = ["CkksEngine"]
