"""EngineBase: parameters, moduli lookup, operand validation and batch grouping for CkksEngine.

Split from the arithmetic so each file reads in one sitting; nothing here computes on residues
except the small-integer lift and the Galois index tables.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fhelium.core import (
    Ciphertext,
    DepthMismatchError,
    FheliumValueError,
    MaximumDepthError,
    ParameterMismatchError,
    Plaintext,
    PolynomialDomain,
    PrimeMismatchError,
    ScaleMismatchError,
    ShapeMismatchError,
    ValueStateError,
)
from fhelium.engine.encoder import SlotEncoder
from fhelium.engine.ntt import NegacyclicNtt
from fhelium.engine.parameters import CkksParameters, Preset, preset_parameters
from fhelium.engine.sampling import RandomSource

# Residues per component handled per group by multi-step batched operations (see _batch_groups).
BATCH_BLOCK_RESIDUES = 1 << 17
# The same with the native kernels, which block for the cache themselves: larger groups save the
# views' copies and the final torch.cat (B=8 at N=2^14 is one group; groups still bound memory).
NATIVE_BATCH_BLOCK_RESIDUES = 1 << 21


# What two operands of one operation must share, in the order checked: (attribute, its error, its name in
# the message). A plaintext operand carries no modulus basis of its own: it is encoded over the Q primes.
_Agreement = tuple[tuple[str, type[FheliumValueError], str], ...]
_PLAINTEXT_AGREEMENT: _Agreement = (
    ("depth", DepthMismatchError, "depths"),
    ("prime_ids", PrimeMismatchError, "primes"),
    ("polynomial_domain", ValueStateError, "polynomial_domain"),
)
_PAIR_AGREEMENT: _Agreement = (*_PLAINTEXT_AGREEMENT, ("modulus_basis", ValueStateError, "modulus_basis"))


def _check_operands_agree(
    operation: str,
    lhs: tuple[str, object],
    rhs: tuple[str, object],
    agreement: _Agreement,
) -> None:
    """Raise the first disagreement of ``agreement``'s attributes between two named operands."""
    (lhs_name, lhs_value), (rhs_name, rhs_value) = lhs, rhs
    for field, error, noun in agreement:
        left, right = getattr(lhs_value, field), getattr(rhs_value, field)
        if left != right:
            raise error(
                f"{operation} requires equal {noun}: {lhs_name}.{field}={_shown(left)!r}, "
                f"{rhs_name}.{field}={_shown(right)!r}"
            )


def _check_equal_scales(
    operation: str, lhs: tuple[str, Ciphertext], rhs: tuple[str, Ciphertext | Plaintext]
) -> None:
    """Refuse two operands whose scales differ at all (CKKS adds only values at one scale)."""
    (lhs_name, lhs_value), (rhs_name, rhs_value) = lhs, rhs
    if lhs_value.scale != rhs_value.scale:
        raise ScaleMismatchError(
            f"{operation} requires exactly equal scales: {lhs_name}.scale={lhs_value.scale!r}, "
            f"{rhs_name}.scale={rhs_value.scale!r}, ratio={lhs_value.scale / rhs_value.scale!r}"
        )


def _shown(value: object) -> object:
    """Prime ids print as a list, as elsewhere in the messages."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class _Moduli:
    q: torch.Tensor  # [rows, 1] int64
    q_inverse: torch.Tensor  # [rows, 1] float64


class EngineBase:
    """State shared by every engine operation: parameters, tables, caches and checks."""

    def __init__(
        self,
        parameters: CkksParameters | Preset | str = Preset.SLOTS8192_SCALE40_DEPTH4,
        *,
        device: torch.device | str = "cpu",
        rng_seed: bytes | int | None = None,
        compile_kernels: bool | None = None,
    ) -> None:
        """``compile_kernels``: opt-in ``torch.compile`` of the NTT butterflies (None: the
        ``FHELIUM_COMPILE=1`` environment variable decides); eager is the default.
        """
        self.parameters = (
            parameters if isinstance(parameters, CkksParameters) else preset_parameters(parameters)
        )
        self.device = torch.device(device)
        self.ring_degree = self.parameters.ring_degree
        self.slot_count = self.parameters.slot_count
        self.moduli: tuple[int, ...] = self.parameters.moduli
        self.q_count = self.parameters.q_count
        self.special_prime_id = self.parameters.special_prime_id
        self.default_scale = self.parameters.default_scale
        self.ntt = NegacyclicNtt(self.ring_degree, self.moduli, self.device, compiled=compile_kernels)
        self.encoder = SlotEncoder(self.ring_degree)
        self.random = RandomSource(rng_seed)
        self._moduli_cache: dict[tuple[int, ...], _Moduli] = {}
        self._galois_cache: dict[int, torch.Tensor] = {}
        self._inverse_cache: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ moduli and checks
    def moduli_for(self, prime_ids: Iterable[int]) -> list[int]:
        ids = list(prime_ids)
        for prime_id in ids:
            if type(prime_id) is not int or not 0 <= prime_id < len(self.moduli):
                raise ParameterMismatchError(
                    f"prime id {prime_id!r} is not one of this engine's {len(self.moduli)} primes"
                )
        return [self.moduli[i] for i in ids]

    def residue_moduli(self, value: Ciphertext) -> list[int]:
        """The prime of each of ``value``'s limbs; ``add_`` is canonical addition modulo them.

        Lets ``all_reduce_ciphertext`` use one SUM all-reduce plus a per-limb remainder.
        """
        return self.moduli_for(value.prime_ids)

    def _mod(self, prime_ids: Sequence[int]) -> _Moduli:
        key = tuple(prime_ids)
        cached = self._moduli_cache.get(key)
        if cached is None:
            q = torch.tensor(self.moduli_for(key), dtype=torch.int64, device=self.device).unsqueeze(-1)
            cached = _Moduli(q, 1.0 / q.double())
            self._moduli_cache[key] = cached
        return cached

    def q_ids_at(self, depth: int) -> tuple[int, ...]:
        if not 0 <= depth <= self.parameters.max_depth:
            raise MaximumDepthError(
                f"depth {depth} is outside this engine's range 0..{self.parameters.max_depth}"
            )
        return self.parameters.q_ids_at(depth)

    def _check_ciphertext(self, value: object, name: str) -> Ciphertext:
        if not isinstance(value, Ciphertext):
            raise FheliumValueError(f"{name} must be a Ciphertext; got {type(value).__name__}")
        if value.ring_dimension != self.ring_degree:
            raise ParameterMismatchError(
                f"{name} has ring dimension {value.ring_dimension}; this engine uses N={self.ring_degree}"
            )
        if value.data.dtype != torch.int64:
            raise ParameterMismatchError(f"{name} must hold int64 residues; got {value.data.dtype}")
        if value.residue_representation != "standard":
            raise ValueStateError(
                f"{name} has Montgomery residues; this engine keeps standard residues in [0, q)"
            )
        if value.data.device != self.device:
            raise ParameterMismatchError(
                f"{name} is on {value.data.device}; this engine runs on {self.device}"
            )
        self.moduli_for(value.prime_ids)
        return value

    def _check_full_layout(self, value: Ciphertext, name: str, operation: str) -> tuple[int, ...]:
        expected = self.q_ids_at(value.depth)
        if value.prime_ids != expected or value.modulus_basis != "Q":
            raise PrimeMismatchError(
                f"{operation} needs every active Q limb of {name}: prime_ids {list(expected)} at depth "
                f"{value.depth}, basis Q; got prime_ids {list(value.prime_ids)}, basis {value.modulus_basis} "
                "(limb slices only support add_/sub_; gather the limbs first)"
            )
        return expected

    def _check_pair(
        self,
        lhs: Ciphertext,
        rhs: Ciphertext,
        operation: str,
        *,
        same_scale: bool = True,
        components: bool = True,
    ) -> None:
        self._check_ciphertext(lhs, "lhs")
        self._check_ciphertext(rhs, "rhs")
        _check_operands_agree(operation, ("lhs", lhs), ("rhs", rhs), _PAIR_AGREEMENT)
        if components and lhs.component_count != rhs.component_count:
            raise ValueStateError(
                f"{operation} requires equal component counts: lhs={lhs.component_count}, "
                f"rhs={rhs.component_count}"
            )
        if same_scale:
            _check_equal_scales(operation, ("lhs", lhs), ("rhs", rhs))
        if components and lhs.data.shape != rhs.data.shape:
            raise ShapeMismatchError(
                f"{operation} requires equal shapes: lhs={tuple(lhs.data.shape)}, rhs={tuple(rhs.data.shape)}"
            )

    def _check_plaintext(self, ct: Ciphertext, pt: object, operation: str, *, same_scale: bool) -> Plaintext:
        if not isinstance(pt, Plaintext) or pt.representation != "rns" or pt.data is None:
            raise FheliumValueError(
                f"{operation} needs an rns Plaintext from CkksEngine.encode; got "
                f"{type(pt).__name__}{'' if not isinstance(pt, Plaintext) else ' ' + repr(pt.representation)}"
            )
        _check_operands_agree(operation, ("ciphertext", ct), ("plaintext", pt), _PLAINTEXT_AGREEMENT)
        if pt.residue_representation != "standard":
            raise ValueStateError(f"{operation}: plaintext must use standard residues")
        if same_scale:
            _check_equal_scales(operation, ("ciphertext", ct), ("plaintext", pt))
        return pt

    # ------------------------------------------------------------------ small helpers
    def _small_to_rns(self, values: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """Signed integers ``[..., N]`` with |x| < min q → residues ``[..., rows, N]``."""
        q = self._mod(prime_ids).q
        x = values.unsqueeze(-2)
        return x + torch.bitwise_and(x >> 63, q)

    def _galois_permutation(self, element: int) -> torch.Tensor:
        """NTT-domain index map of X → X^element: out[t] = in[perm[t]]."""
        cached = self._galois_cache.get(element)
        if cached is None:
            n = self.ring_degree
            t = torch.arange(n, dtype=torch.int64)
            cached = (((2 * t + 1) * element) % (2 * n) - 1).div(2, rounding_mode="floor").to(self.device)
            self._galois_cache[element] = cached
        return cached

    def _apply_galois(self, data: torch.Tensor, element: int, domain: PolynomialDomain) -> torch.Tensor:
        if domain == "ntt":
            if self.ntt.native_level != "torch" and data.dtype == torch.int64:
                from fhelium import native  # one native gather pass; index_select is the reference

                return native.permute_last(data, self._galois_permutation(element))
            return data.index_select(-1, self._galois_permutation(element))
        raise ValueStateError("Galois automorphisms are applied in the NTT domain; call to_ntt first")

    # ------------------------------------------------------------------ batch grouping
    def _batch_groups(
        self, batch_shape: tuple[int, ...], limbs: int, *, sampled: bool = False
    ) -> list[slice] | None:
        """Slices of the flattened batch, each about BATCH_BLOCK_RESIDUES residues per component.

        Multi-step operations (rescale, key switching, encryption) create several temporaries
        per input; running them a cache-sized group at a time measured faster per ciphertext
        than streaming a whole large batch through every step (docs/fhelium-performance.md).
        """
        total = math.prod(batch_shape)
        # ``sampled``: the groups fix the order of the random draws (encryption), so they must not
        # depend on the dispatch level: the same seed gives the same ciphertext at every level
        native = self.ntt.native_level != "torch" and not sampled
        budget = NATIVE_BATCH_BLOCK_RESIDUES if native else BATCH_BLOCK_RESIDUES
        per_group = max(1, budget // (limbs * self.ring_degree))
        if not batch_shape or total <= per_group:
            return None
        return [slice(start, start + per_group) for start in range(0, total, per_group)]

    @staticmethod
    def _ciphertext_part(ct: Ciphertext, part: slice) -> Ciphertext:
        flat = ct.data.reshape(ct.component_count, ct.batch_size, ct.limb_count, ct.ring_dimension)
        return ct.with_data(flat[:, part])

    @staticmethod
    def _plaintext_part(pt: Plaintext, part: slice) -> Plaintext:
        if not pt.batch_shape:
            return pt
        assert pt.data is not None
        flat = pt.data.reshape(math.prod(pt.batch_shape), *pt.data.shape[-2:])
        return pt.with_tensor(flat[part])

    @staticmethod
    def _join(parts: list[Ciphertext], batch_shape: tuple[int, ...]) -> Ciphertext:
        data = torch.cat([p.data for p in parts], dim=1)
        return parts[0].with_data(data.view(data.size(0), *batch_shape, *data.shape[-2:]))
