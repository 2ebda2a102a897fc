"""CompressedPlaintext: an RNS plaintext whose last axis repeats a short pattern, stored once."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from fhelium.core.errors import FheliumValueError
from fhelium.core.plaintext import Plaintext
from fhelium.core.resident import TensorResident
from fhelium.core.state import (
    COMPRESSED_PLAINTEXT_LAYOUTS,
    CompressedPlaintextLayout,
    LeveledRnsFields,
    check_choice,
    check_integer_tensor,
)

COMPRESSED_PLAINTEXT_FORMAT_VERSION = 1


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(eq=False)
class _CompressedLeading:
    """A CompressedPlaintext's leading constructor fields (see ``LeveledRnsFields``)."""

    data: torch.Tensor
    ring_dimension: int
    compression_layout: CompressedPlaintextLayout


@dataclass(eq=False)
class CompressedPlaintext(LeveledRnsFields, _CompressedLeading, TensorResident):
    """``data [*batch, limb, unique]`` expands losslessly to ``[*batch, limb, ring_dimension]``.

    ``CompressedPlaintext(data, ring_dimension, compression_layout, depth, scale, prime_ids, …,
    implicit_data=None, compression_format_version=1)``. Layouts: ``cyclic`` repeats the whole pattern;
    ``contiguous`` repeats each entry in place; ``strided_sparse`` puts ``data`` at positions
    ``::repeat_count`` and ``implicit_data`` (``[*batch, limb]``) everywhere else.
    """

    implicit_data: torch.Tensor | None = None
    compression_format_version: int = COMPRESSED_PLAINTEXT_FORMAT_VERSION

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("data", "implicit_data")

    def __post_init__(self) -> None:
        owner = "CompressedPlaintext"
        check_integer_tensor(owner, "data", self.data, min_ndim=2)
        if type(self.ring_dimension) is not int or not _is_power_of_two(self.ring_dimension):
            raise FheliumValueError(
                f"{owner} ring_dimension must be a power-of-two int; got {self.ring_dimension!r}"
            )
        self.compression_layout = check_choice(  # type: ignore[assignment]  # narrowed by the check
            owner, "compression_layout", self.compression_layout, COMPRESSED_PLAINTEXT_LAYOUTS
        )
        self._check_level(owner)
        self._check_rns_metadata(owner, self.data)
        if self.compression_format_version != COMPRESSED_PLAINTEXT_FORMAT_VERSION:
            raise FheliumValueError(
                f"{owner} compression_format_version must be {COMPRESSED_PLAINTEXT_FORMAT_VERSION}; "
                f"got {self.compression_format_version!r}"
            )
        unique = self.unique_count
        if not _is_power_of_two(unique) or unique >= self.ring_dimension:
            raise FheliumValueError(
                f"{owner} unique_count (last axis of data) must be a power of two below ring_dimension="
                f"{self.ring_dimension}; got {unique}"
            )
        if self.compression_layout == "strided_sparse":
            if self.implicit_data is None:
                raise FheliumValueError(
                    f"{owner} strided_sparse layout requires implicit_data [*batch, limb]"
                )
            if self.polynomial_domain != "coefficient":
                raise FheliumValueError(f"{owner} strided_sparse layout requires the coefficient domain")
            check_integer_tensor(owner, "implicit_data", self.implicit_data, min_ndim=1)
            if tuple(self.implicit_data.shape) != tuple(self.data.shape[:-1]):
                raise FheliumValueError(
                    f"{owner} implicit_data shape must be {tuple(self.data.shape[:-1])}; "
                    f"got {tuple(self.implicit_data.shape)}"
                )
        elif self.implicit_data is not None:
            raise FheliumValueError(f"{owner} implicit_data is only allowed for the strided_sparse layout")

    @property
    def unique_count(self) -> int:
        return int(self.data.size(-1))

    @property
    def repeat_count(self) -> int:
        return self.ring_dimension // self.unique_count

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[:-2])

    def decompress_data(self) -> torch.Tensor:
        if self.compression_layout == "cyclic":
            return self.data.repeat(*([1] * (self.data.ndim - 1)), self.repeat_count)
        if self.compression_layout == "contiguous":
            return self.data.repeat_interleave(self.repeat_count, dim=-1)
        assert self.implicit_data is not None
        full = self.implicit_data.unsqueeze(-1).expand(*self.data.shape[:-1], self.ring_dimension).clone()
        full[..., :: self.repeat_count] = self.data
        return full

    def to_plaintext(self) -> Plaintext:
        return Plaintext(
            None,
            self.depth,
            self.scale,
            self.decompress_data(),
            "rns",
            self.polynomial_domain,
            self.modulus_basis,
            self.residue_representation,
            self.prime_ids,
        )

    @classmethod
    def from_plaintext(
        cls, plaintext: Plaintext, *, unique_count: int, compression_layout: CompressedPlaintextLayout
    ) -> CompressedPlaintext:
        """Compress an rns plaintext; refuses unless the expansion reproduces it bit for bit."""
        if plaintext.representation != "rns" or plaintext.data is None:
            raise FheliumValueError("CompressedPlaintext.from_plaintext needs an rns Plaintext")
        full = plaintext.data
        n = int(full.size(-1))
        if not _is_power_of_two(unique_count) or unique_count >= n:
            raise FheliumValueError(f"unique_count must be a power of two below {n}; got {unique_count}")
        repeat = n // unique_count
        implicit = None
        if compression_layout == "cyclic":
            data = full[..., :unique_count]
        elif compression_layout == "contiguous":
            data = full[..., ::repeat]
        else:
            data = full[..., ::repeat]
            implicit = full[..., 1] if repeat > 1 else full[..., 0]
        assert plaintext.polynomial_domain is not None
        assert plaintext.modulus_basis is not None and plaintext.residue_representation is not None
        value = cls(
            data.contiguous(),
            n,
            compression_layout,
            plaintext.depth,
            plaintext.scale,
            plaintext.prime_ids,
            plaintext.polynomial_domain,
            plaintext.modulus_basis,
            plaintext.residue_representation,
            None if implicit is None else implicit.contiguous(),
        )
        if not torch.equal(value.decompress_data(), full):
            raise FheliumValueError(
                f"Plaintext is not exactly representable as {compression_layout} with "
                f"unique_count={unique_count}"
            )
        return value

    def with_storage(
        self, data: torch.Tensor, implicit_data: torch.Tensor | None = None
    ) -> CompressedPlaintext:
        return replace(self, data=data, implicit_data=implicit_data)

    def with_data(self, data: torch.Tensor) -> CompressedPlaintext:
        return self.with_storage(data, self.implicit_data)

