"""Ciphertext: an RNS tensor ``[component, *batch, limb, N]`` plus the metadata that gives it meaning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Self

import torch

from fhelium.core.errors import FheliumValueError, ShapeMismatchError, ValueStateError
from fhelium.core.resident import TensorResident
from fhelium.core.state import (
    LeveledRnsFields,
    ModulusBasis,
    PolynomialDomain,
    ResidueRepresentation,
    RnsTensor,
)


@dataclass(eq=False)
class _CiphertextData:
    """A Ciphertext's leading constructor field (see ``LeveledRnsFields``)."""

    data: torch.Tensor


@dataclass(eq=False)
class Ciphertext(LeveledRnsFields, _CiphertextData, RnsTensor, TensorResident):
    """A CKKS ciphertext (or a batch of them sharing one metadata record).

    ``Ciphertext(data, depth, scale, prime_ids, polynomial_domain="coefficient", modulus_basis="Q",
    residue_representation="standard")``. Limb row ``j`` holds residues modulo the prime with id
    ``prime_ids[j]``. Construction never copies ``data``; it checks structure, not agreement with any
    engine.
    """

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("data",)

    def __post_init__(self) -> None:
        owner = "Ciphertext"
        self._check_data(owner, min_ndim=3)
        if self.data.size(0) not in (2, 3):
            raise FheliumValueError(
                "Ciphertext component axis (dim 0) must have extent 2 or 3; got shape "
                f"{tuple(self.data.shape)}"
            )
        self._check_level(owner)
        self._check_rns_metadata(owner, self.data)
        if self.polynomial_domain == "coefficient" and self.residue_representation == "montgomery":
            raise FheliumValueError("Coefficient-domain Ciphertext cannot use Montgomery residues")

    # -- derived shape facts -------------------------------------------------------------------
    @property
    def component_count(self) -> int:
        return int(self.data.size(0))

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[1:-2])

    @property
    def batch_size(self) -> int:
        size = 1
        for extent in self.batch_shape:
            size *= extent
        return size

    @property
    def is_batched(self) -> bool:
        return bool(self.batch_shape)

    @property
    def is_ntt_domain(self) -> bool:
        return self.polynomial_domain == "ntt"

    @property
    def includes_p(self) -> bool:
        return self.modulus_basis == "QP"

    def component(self, index: int) -> torch.Tensor:
        return self.data[index]

    @property
    def c0(self) -> torch.Tensor:
        return self.data[0]

    @property
    def c1(self) -> torch.Tensor:
        return self.data[1]

    @property
    def c2(self) -> torch.Tensor:
        if self.component_count < 3:
            raise ValueStateError("Ciphertext has no c2: it has 2 components (relinearized)")
        return self.data[2]

    def assert_state(
        self,
        *,
        polynomial_domain: PolynomialDomain | None = None,
        residue_representation: ResidueRepresentation | None = None,
        modulus_basis: ModulusBasis | None = None,
        components: int | None = None,
        name: str = "ciphertext",
    ) -> None:
        """Raise ``ValueStateError`` naming the value if any requested axis differs."""
        wanted = {
            "polynomial_domain": polynomial_domain,
            "residue_representation": residue_representation,
            "modulus_basis": modulus_basis,
        }
        for field, expected in wanted.items():
            if expected is not None and getattr(self, field) != expected:
                raise ValueStateError(f"{name} must have {field}={expected!r}; got {getattr(self, field)!r}")
        if components is not None and self.component_count != components:
            raise ValueStateError(f"{name} must have {components} components; got {self.component_count}")

    # -- storage-preserving views and copies ---------------------------------------------------
    def with_data(self, data: torch.Tensor) -> Ciphertext:
        """Same metadata around ``data`` (aliased, not copied)."""
        return replace(self, data=data)

    def clone(self) -> Ciphertext:
        return self.with_data(self.data.clone())

    def slice_limbs(self, start: int, stop: int) -> Ciphertext:
        """A view of limb rows ``start:stop``; writes through it change this ciphertext."""
        limbs = self.limb_count
        if type(start) is not int or type(stop) is not int or not 0 <= start < stop <= limbs:
            raise FheliumValueError(
                f"Ciphertext limb slice must satisfy 0 <= start < stop <= {limbs}; "
                f"got start={start!r}, stop={stop!r}"
            )
        return replace(self, data=self.data[..., start:stop, :], prime_ids=self.prime_ids[start:stop])

    @classmethod
    def stack_batch(cls, values: Sequence[Ciphertext]) -> Ciphertext:
        """Stack values along a new batch axis (dim 1); all must agree in metadata and layout."""
        if not values:
            raise FheliumValueError("Ciphertext.stack_batch needs at least one value")
        first = values[0]
        for index, value in enumerate(values[1:], start=1):
            if not isinstance(value, Ciphertext):
                raise FheliumValueError(
                    f"Ciphertext.stack_batch values[{index}] is {type(value).__name__}, not Ciphertext"
                )
            if not first.metadata_equal(value):
                raise FheliumValueError(
                    f"Ciphertext.stack_batch values[{index}] metadata differs from values[0]"
                )
            if (value.data.shape, value.data.dtype, value.data.device) != (
                first.data.shape,
                first.data.dtype,
                first.data.device,
            ):
                raise ShapeMismatchError(
                    f"Ciphertext.stack_batch values[{index}] has shape/dtype/device "
                    f"{tuple(value.data.shape)}/{value.data.dtype}/{value.data.device}; values[0] has "
                    f"{tuple(first.data.shape)}/{first.data.dtype}/{first.data.device}"
                )
        return first.with_data(torch.stack([v.data for v in values], dim=1))

    def select_batch(self, index: int, dim: int = 0) -> Ciphertext:
        """A view of one entry of batch axis ``dim``."""
        if not 0 <= dim < len(self.batch_shape):
            raise FheliumValueError(
                f"Ciphertext batch dim must be in [0, {len(self.batch_shape)}); got {dim}"
            )
        return self.with_data(self.data.select(1 + dim, index))

    def unbind_batch(self, dim: int = 0) -> tuple[Ciphertext, ...]:
        if not 0 <= dim < len(self.batch_shape):
            raise FheliumValueError(
                f"Ciphertext batch dim must be in [0, {len(self.batch_shape)}); got {dim}"
            )
        return tuple(self.with_data(t) for t in self.data.unbind(1 + dim))

    def replace_(self, other: Ciphertext) -> Self:
        """Rebind every field to ``other``'s, keeping this object's identity."""
        self.data = other.data
        self.depth = other.depth
        self.scale = other.scale
        self.prime_ids = other.prime_ids
        self.polynomial_domain = other.polynomial_domain
        self.modulus_basis = other.modulus_basis
        self.residue_representation = other.residue_representation
        return self

    def __repr__(self) -> str:
        return (
            f"Ciphertext(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, depth={self.depth}, "
            f"scale={self.scale!r}, prime_ids={list(self.prime_ids)}, domain={self.polynomial_domain}, "
            f"basis={self.modulus_basis}, residue={self.residue_representation})"
        )
