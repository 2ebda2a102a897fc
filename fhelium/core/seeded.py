"""SeededCiphertext: a fresh secret-key ciphertext stored as (c0, seed of the uniform c1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fhelium.core.errors import FheliumValueError
from fhelium.core.resident import TensorResident
from fhelium.core.state import (
    LevelMetadata,
    PolynomialDomain,
    check_domain,
    check_integer_tensor,
    check_limb_axis,
    coerce_prime_ids,
)

SEED_BYTES = 32


@dataclass(eq=False)
class SeededCiphertext(LevelMetadata, TensorResident):
    """About half the size of a Ciphertext: c1 is re-expanded from ``seed`` by the engine.

    Only fresh encryptions have this form; any homomorphic operation needs the expanded
    ``Ciphertext`` (``CkksEngine.expand_seeded``).
    """

    c0: torch.Tensor
    seed: bytes
    depth: int
    scale: float
    prime_ids: tuple[int, ...]
    polynomial_domain: PolynomialDomain = "ntt"

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ("c0",)

    def __post_init__(self) -> None:
        owner = "SeededCiphertext"
        check_integer_tensor(owner, "c0", self.c0, min_ndim=2)
        if not isinstance(self.seed, bytes) or len(self.seed) != SEED_BYTES:
            raise FheliumValueError(f"{owner} seed must be {SEED_BYTES} bytes; got {self.seed!r}")
        self._check_level(owner)
        self.prime_ids = coerce_prime_ids(owner, self.prime_ids)
        check_limb_axis(owner, self.c0, self.prime_ids)
        self.polynomial_domain = check_domain(owner, self.polynomial_domain)
        if self.polynomial_domain != "ntt":
            raise FheliumValueError(f"{owner} is produced in the NTT domain only")

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.c0.shape[:-2])

    @property
    def ring_dimension(self) -> int:
        return int(self.c0.size(-1))

