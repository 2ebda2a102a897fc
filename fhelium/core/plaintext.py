"""Plaintext: a message as slots, integer/approximate coefficients, or RNS residues."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from fhelium.core.errors import FheliumValueError
from fhelium.core.resident import TensorResident
from fhelium.core.state import (
    PLAINTEXT_REPRESENTATIONS,
    LevelMetadata,
    ModulusBasis,
    PlaintextRepresentation,
    PolynomialDomain,
    ResidueRepresentation,
    RnsMetadata,
    check_choice,
    check_integer_tensor,
    coerce_prime_ids,
)


@dataclass(eq=False)
class Plaintext(LevelMetadata, RnsMetadata, TensorResident):
    """An unencrypted CKKS value.

    ``representation`` decides which tensor is present and what it means:
    ``slots`` → ``message`` (scalar or ``[*batch, slot]``, real or complex);
    ``integer_coefficients`` → integral ``data [*batch, N]``;
    ``approximate_coefficients`` → float64 ``data [*batch, N]`` (what decryption yields);
    ``rns`` → integral ``data [*batch, limb, N]`` with domain/basis/residue/prime_ids.
    """

    message: torch.Tensor | None
    depth: int
    scale: float
    data: torch.Tensor | None = None
    representation: PlaintextRepresentation = "slots"
    polynomial_domain: PolynomialDomain | None = None
    modulus_basis: ModulusBasis | None = None
    residue_representation: ResidueRepresentation | None = None
    prime_ids: tuple[int, ...] = ()

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("message", "data")

    def __post_init__(self) -> None:
        owner = "Plaintext"
        self._check_level(owner)
        rep = check_choice(owner, "representation", self.representation, PLAINTEXT_REPRESENTATIONS)
        if (self.message is None) == (self.data is None):
            raise FheliumValueError(
                "Plaintext must own exactly one representation tensor: message (slots) or data "
                f"(coefficients/rns); got message={'set' if self.message is not None else 'None'}, "
                f"data={'set' if self.data is not None else 'None'}"
            )
        self.prime_ids = coerce_prime_ids(owner, self.prime_ids, allow_empty=True)
        if rep == "slots":
            if self.message is None:
                raise FheliumValueError("Plaintext representation 'slots' needs message, not data")
            if not isinstance(self.message, torch.Tensor):
                raise FheliumValueError(
                    f"Plaintext message must be a torch.Tensor; got {type(self.message).__name__}"
                )
            self._require_no_rns_state("slots")
            return
        if self.data is None:
            raise FheliumValueError(f"Plaintext representation {rep!r} needs data, not message")
        if rep in ("integer_coefficients", "approximate_coefficients"):
            if rep == "integer_coefficients":
                check_integer_tensor(owner, "data", self.data, min_ndim=1)
            elif not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float64:
                raise FheliumValueError("Plaintext approximate_coefficients data must be a float64 tensor")
            elif not bool(torch.isfinite(self.data).all()):
                raise FheliumValueError("Plaintext approximate_coefficients data must be finite")
            if self.polynomial_domain not in (None, "coefficient"):
                raise FheliumValueError(
                    f"Plaintext {rep} must have polynomial_domain 'coefficient'; got "
                    f"{self.polynomial_domain!r}"
                )
            self.polynomial_domain = "coefficient"
            if self.modulus_basis is not None or self.residue_representation is not None or self.prime_ids:
                raise FheliumValueError(
                    f"Plaintext {rep} carries no modulus_basis, residue_representation or prime_ids"
                )
            return
        check_integer_tensor(owner, "data", self.data, min_ndim=2)
        if not self.prime_ids:
            raise FheliumValueError("Plaintext rns representation needs non-empty prime_ids")
        self._check_rns_metadata(owner, self.data)

    def _require_no_rns_state(self, rep: str) -> None:
        if (
            self.polynomial_domain is not None
            or self.modulus_basis is not None
            or self.residue_representation is not None
            or self.prime_ids
        ):
            raise FheliumValueError(
                f"Plaintext {rep} carries no polynomial_domain, modulus_basis, "
                "residue_representation or prime_ids"
            )

    @property
    def tensor(self) -> torch.Tensor:
        """The one payload tensor (message or data)."""
        payload = self.message if self.message is not None else self.data
        assert payload is not None  # guaranteed by __post_init__
        return payload

    @property
    def batch_shape(self) -> tuple[int, ...]:
        if self.representation == "rns":
            return tuple(self.tensor.shape[:-2])
        return tuple(self.tensor.shape[:-1]) if self.tensor.ndim else ()

    def with_tensor(self, tensor: torch.Tensor) -> Plaintext:
        if self.message is not None:
            return replace(self, message=tensor)
        return replace(self, data=tensor)

    def clone(self) -> Plaintext:
        return self.with_tensor(self.tensor.clone())

    @classmethod
    def stack_batch(cls, values: Sequence[Plaintext]) -> Plaintext:
        if not values:
            raise FheliumValueError("Plaintext.stack_batch needs at least one value")
        first = values[0]
        if first.representation == "slots" and first.tensor.ndim == 0:
            raise FheliumValueError("Plaintext.stack_batch cannot stack scalar slot messages")
        for index, value in enumerate(values):
            if not (value.metadata_equal(first) and value.tensor.shape == first.tensor.shape):
                raise FheliumValueError(f"Plaintext.stack_batch values[{index}] differs from values[0]")
        dim = 0
        return first.with_tensor(torch.stack([v.tensor for v in values], dim=dim))

