"""Key values: secret, public, and key-switching keys (relinearization, rotation, conjugation)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Self, get_args

import torch

from fhelium.core.errors import FheliumValueError
from fhelium.core.resident import TensorResident
from fhelium.core.state import (
    ModulusBasis,
    PolynomialDomain,
    ResidueRepresentation,
    RnsTensor,
)


@dataclass(eq=False)
class DenseKey(RnsTensor, TensorResident):
    """The common base of every key: one RNS tensor with prime ids, domain and basis."""

    data: torch.Tensor
    prime_ids: tuple[int, ...]
    polynomial_domain: PolynomialDomain = "ntt"
    modulus_basis: ModulusBasis = "QP"
    residue_representation: ResidueRepresentation = "standard"

    #: number of leading axes before the limb axis, per key class
    LEADING_AXES = 0
    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("data",)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self._check_data(owner, min_ndim=self.LEADING_AXES + 2)
        if self.data.ndim != self.LEADING_AXES + 2:
            raise FheliumValueError(
                f"{owner} data must have {self.LEADING_AXES + 2} dimensions; got shape "
                f"{tuple(self.data.shape)}"
            )
        self._check_rns_metadata(owner, self.data)
        self._check_extra()

    def _check_extra(self) -> None:
        pass

    def with_data(self, data: torch.Tensor) -> Self:
        """The same key (class and metadata, a RotationKey's step too) around ``data``."""
        return replace(self, data=data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.data.shape)}, prime_ids={list(self.prime_ids)})"


@dataclass(eq=False, repr=False)
class SecretKey(DenseKey):
    """``data [limb, N]``: the ternary secret s as residues over all primes (Q and P)."""


@dataclass(eq=False, repr=False)
class PublicKey(DenseKey):
    """``data [2, limb, N]``: (k0, k1) = (-a·s + e, a) over Q."""

    LEADING_AXES = 1
    modulus_basis: ModulusBasis = "Q"

    def _check_extra(self) -> None:
        if self.data.size(0) != 2:
            raise FheliumValueError(
                f"PublicKey data must have 2 components; got shape {tuple(self.data.shape)}"
            )

    @property
    def k0(self) -> torch.Tensor:
        return self.data[0]

    @property
    def k1(self) -> torch.Tensor:
        return self.data[1]

    def component(self, index: int) -> torch.Tensor:
        return self.data[index]


@dataclass(eq=False, repr=False)
class KeySwitchKey(DenseKey):
    """``data [digit, 2, limb, N]``: per decomposition digit, an encryption of P·s_src under s_dst."""

    LEADING_AXES = 2

    def _check_extra(self) -> None:
        if self.data.size(1) != 2:
            raise FheliumValueError(
                f"{type(self).__name__} data must have 2 components per digit; got shape "
                f"{tuple(self.data.shape)}"
            )

    @property
    def digit_count(self) -> int:
        return int(self.data.size(0))

    def digit(self, index: int) -> torch.Tensor:
        return self.data[index]

    def digit_component(self, index: int, component: int) -> torch.Tensor:
        return self.data[index, component]


@dataclass(eq=False, repr=False)
class RelinearizationKey(KeySwitchKey):
    """Switches s² back to s after a ciphertext-ciphertext multiply."""


@dataclass(eq=False, repr=False)
class ConjugationKey(KeySwitchKey):
    """Switches σ_{-1}(s) back to s after complex conjugation of the slots."""


@dataclass(eq=False, repr=False)
class RotationKey(KeySwitchKey):
    """Switches σ_g(s) back to s for a rotation by ``rotation_step`` slots."""

    rotation_step: int = field(default=0, kw_only=True)

    def _check_extra(self) -> None:
        super()._check_extra()
        if type(self.rotation_step) is not int:
            raise FheliumValueError(f"RotationKey rotation_step must be an int; got {self.rotation_step!r}")
        slots = self.ring_dimension // 2
        self.rotation_step = canonical_rotation_step(self.rotation_step, slots)

    def __repr__(self) -> str:
        return f"RotationKey(step={self.rotation_step}, shape={tuple(self.data.shape)})"


AnyKey = SecretKey | PublicKey | KeySwitchKey | RotationKey | RelinearizationKey | ConjugationKey
"""A value of any concrete key class."""

KEY_TYPES: tuple[type[DenseKey], ...] = get_args(AnyKey)
"""Every concrete key class, in AnyKey's order (what a value file or a key broadcast may hold)."""


def canonical_rotation_step(step: int, slots: int) -> int:
    """The representative of ``step`` modulo ``slots`` in ``[-slots/2, slots/2)``."""
    reduced = step % slots
    return reduced - slots if reduced >= slots // 2 else reduced
