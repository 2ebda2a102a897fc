"""The state axes every RNS value carries, and validators shared by the value classes.

Metadata is plain Python (``int``, ``float``, ``str``, ``tuple``); validators reject look-alikes
(``bool``, numpy integers, lists where tuples are stored) so that metadata compares and serializes
exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch

from fhelium.core.errors import FheliumValueError

PolynomialDomain = Literal["coefficient", "ntt"]
ModulusBasis = Literal["Q", "QP"]
ResidueRepresentation = Literal["standard", "montgomery"]
PlaintextRepresentation = Literal["slots", "integer_coefficients", "approximate_coefficients", "rns"]
CompressedPlaintextLayout = Literal["cyclic", "contiguous", "strided_sparse"]

POLYNOMIAL_DOMAINS: tuple[str, ...] = get_args(PolynomialDomain)
MODULUS_BASES: tuple[str, ...] = get_args(ModulusBasis)
RESIDUE_REPRESENTATIONS: tuple[str, ...] = get_args(ResidueRepresentation)
PLAINTEXT_REPRESENTATIONS: tuple[str, ...] = get_args(PlaintextRepresentation)
COMPRESSED_PLAINTEXT_LAYOUTS: tuple[str, ...] = get_args(CompressedPlaintextLayout)

INTEGER_DTYPES = (torch.int64, torch.int32)


def check_choice(owner: str, field: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise FheliumValueError(f"{owner} {field} must be one of {list(choices)}; got {value!r}")
    return value


def check_domain(owner: str, value: object) -> PolynomialDomain:
    return cast(PolynomialDomain, check_choice(owner, "polynomial_domain", value, POLYNOMIAL_DOMAINS))


def check_basis(owner: str, value: object) -> ModulusBasis:
    return cast(ModulusBasis, check_choice(owner, "modulus_basis", value, MODULUS_BASES))


def check_residue(owner: str, value: object) -> ResidueRepresentation:
    return cast(
        ResidueRepresentation,
        check_choice(owner, "residue_representation", value, RESIDUE_REPRESENTATIONS),
    )


def check_depth(owner: str, depth: object) -> int:
    if type(depth) is not int or depth < 0:
        raise FheliumValueError(f"{owner} depth must be a non-negative int; got {depth!r}")
    return depth


def coerce_scale(owner: str, scale: object) -> float:
    """Scales are binary64 and must be positive and finite; bools and strings are refused."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise FheliumValueError(f"{owner} scale must be a positive finite float; got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise FheliumValueError(f"{owner} scale must be a positive finite float; got {scale!r}")
    return value


def coerce_prime_ids(owner: str, prime_ids: object, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Prime ids name which modulus each limb row is reduced by; strictly increasing ints."""
    if isinstance(prime_ids, (str, bytes)) or not isinstance(prime_ids, Sequence):
        raise FheliumValueError(f"{owner} prime_ids must be a sequence of ints; got {prime_ids!r}")
    ids = tuple(prime_ids)
    if not ids and not allow_empty:
        raise FheliumValueError(f"{owner} prime_ids must not be empty")
    for item in ids:
        if type(item) is not int or item < 0:
            raise FheliumValueError(f"{owner} prime_ids must be non-negative ints; got {list(ids)}")
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise FheliumValueError(f"{owner} prime_ids must be strictly increasing: {list(ids)}")
    return ids


def check_integer_tensor(owner: str, name: str, tensor: object, *, min_ndim: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise FheliumValueError(f"{owner} {name} must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dtype not in INTEGER_DTYPES:
        raise FheliumValueError(
            f"{owner} {name} must have dtype int64 or int32; got {tensor.dtype} "
            "(residues are stored as signed machine integers)"
        )
    if tensor.layout is not torch.strided:
        raise FheliumValueError(f"{owner} {name} must be a dense strided tensor; got {tensor.layout}")
    if tensor.ndim < min_ndim:
        raise FheliumValueError(
            f"{owner} {name} must have at least {min_ndim} dimensions; got shape {tuple(tensor.shape)}"
        )
    if any(extent == 0 for extent in tensor.shape):
        raise FheliumValueError(f"{owner} {name} must not have empty axes; got shape {tuple(tensor.shape)}")
    return tensor


def check_limb_axis(owner: str, tensor: torch.Tensor, prime_ids: tuple[int, ...]) -> None:
    if tensor.size(-2) != len(prime_ids):
        raise FheliumValueError(
            f"{owner} limb axis has {tensor.size(-2)} rows but prime_ids names {len(prime_ids)} "
            f"primes: {list(prime_ids)}"
        )


class LevelMetadata:
    """A value's depth and scale, and the one way they are checked.

    A mixin for the value dataclasses that carry them (Ciphertext, CompressedPlaintext, Plaintext,
    SeededCiphertext): they declare the fields (the first two through ``LeveledRnsFields``), then call
    ``_check_level`` from ``__post_init__``.
    """

    depth: int
    scale: float

    def _check_level(self, owner: str) -> None:
        """A non-negative int depth; a positive finite scale, stored as a float."""
        self.depth = check_depth(owner, self.depth)
        self.scale = coerce_scale(owner, self.scale)


class RnsMetadata:
    """The RNS metadata of a value with a limb axis, and the one way it is checked.

    A mixin for the value dataclasses (Ciphertext, CompressedPlaintext, an ``rns`` Plaintext and every
    key): they declare these fields with their own defaults (the first two through ``LeveledRnsFields``),
    then call ``_check_rns_metadata`` from ``__post_init__``.
    """

    prime_ids: tuple[int, ...]
    polynomial_domain: PolynomialDomain | None
    modulus_basis: ModulusBasis | None
    residue_representation: ResidueRepresentation | None

    def _check_rns_metadata(self, owner: str, data: torch.Tensor) -> None:
        """Non-empty prime ids, one limb row per prime, then the domain, basis and residue axes.

        Each is stored as checked (a tuple of ints, narrowed literals).
        """
        self.prime_ids = coerce_prime_ids(owner, self.prime_ids)
        check_limb_axis(owner, data, self.prime_ids)
        self.polynomial_domain = check_domain(owner, self.polynomial_domain)
        self.modulus_basis = check_basis(owner, self.modulus_basis)
        self.residue_representation = check_residue(owner, self.residue_representation)


@dataclass(eq=False)
class LeveledRnsFields(LevelMetadata, RnsMetadata):
    """The level and RNS metadata fields of a ciphertext-like value (Ciphertext, CompressedPlaintext), with
    their defaults: coefficient domain, basis Q, standard residues.

    A dataclass takes its bases' fields in reverse MRO order, then its own, so a value lists this base
    first and a dataclass of its leading fields after it (``class Ciphertext(LeveledRnsFields,
    _CiphertextData, ...)``): its constructor takes the leading fields, these six, then its own.
    """

    depth: int
    scale: float
    prime_ids: tuple[int, ...]
    polynomial_domain: PolynomialDomain = "coefficient"
    modulus_basis: ModulusBasis = "Q"
    residue_representation: ResidueRepresentation = "standard"


class RnsTensor(RnsMetadata):
    """RnsMetadata of a value whose one tensor ``data`` ends ``[..., limb, N]`` (Ciphertext, every key)."""

    data: torch.Tensor

    def _check_data(self, owner: str, *, min_ndim: int) -> None:
        """``data`` is a dense int64/int32 tensor with no empty axis and at least ``min_ndim`` axes."""
        check_integer_tensor(owner, "data", self.data, min_ndim=min_ndim)

    @property
    def limb_count(self) -> int:
        return int(self.data.size(-2))

    @property
    def ring_dimension(self) -> int:
        return int(self.data.size(-1))
