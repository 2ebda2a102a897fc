"""CKKS parameters, named presets and the 128-bit security check.

Prime layout (canonical id order): ``[scale primes (dropped first) | base prime | special prime]``.
A ciphertext at depth d holds Q ids ``d .. q_count-1``; rescale drops ``prime_ids[0]``.
Key switching uses one digit per Q prime and one special prime P (as SEAL does), so P must be
at least as large as every Q prime for the switching noise to stay small.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fhelium.engine.modular import MAX_PRIME_BITS
from fhelium.engine.primes import ntt_primes

# Largest log2(Q·P) for 128-bit classical security with a ternary secret
# (HomomorphicEncryption.org standard, Table 1; the same table SEAL enforces).
MAX_MODULUS_BITS_128 = {10: 27, 11: 54, 12: 109, 13: 218, 14: 438, 15: 881, 16: 1772}

MIN_PRIME_BITS = 20
ERROR_STANDARD_DEVIATION = 3.19


class CkksParameters(BaseModel):
    """Everything that fixes the ring and the moduli; primes are derived deterministically."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    log_ring_degree: int = Field(ge=3, le=16)
    scale_bits: int = Field(ge=10, le=MAX_PRIME_BITS)
    scale_prime_bits: tuple[int, ...] = Field(min_length=0)
    base_prime_bits: int
    special_prime_bits: int
    enforce_security: bool = True

    @model_validator(mode="after")
    def _check(self) -> CkksParameters:
        for name, bits in (
            *(("scale_prime_bits", b) for b in self.scale_prime_bits),
            ("base_prime_bits", self.base_prime_bits),
            ("special_prime_bits", self.special_prime_bits),
        ):
            if not MIN_PRIME_BITS <= bits <= MAX_PRIME_BITS:
                raise ValueError(
                    f"{name} entries must be between {MIN_PRIME_BITS} and {MAX_PRIME_BITS} bits "
                    f"(the int64 kernels are exact only below 2**{MAX_PRIME_BITS}); got {bits}"
                )
        if self.special_prime_bits < max((*self.scale_prime_bits, self.base_prime_bits)):
            raise ValueError(
                f"special_prime_bits={self.special_prime_bits} must be at least the largest Q prime "
                f"({max((*self.scale_prime_bits, self.base_prime_bits))} bits), or key switching adds "
                "noise larger than the scale"
            )
        if self.enforce_security:
            if self.log_ring_degree not in MAX_MODULUS_BITS_128:
                raise ValueError(
                    f"N = 2^{self.log_ring_degree} is below the 128-bit security table (2^10 .. 2^16); "
                    "rings this small are for tests only: pass enforce_security=False"
                )
            limit = MAX_MODULUS_BITS_128[self.log_ring_degree]
            if self.total_modulus_bits > limit:
                raise ValueError(
                    f"log2(Q·P) = {self.total_modulus_bits} bits exceeds the 128-bit security limit of "
                    f"{limit} bits for N = 2^{self.log_ring_degree}; use fewer/smaller primes, a larger "
                    "ring, or enforce_security=False for toy test rings"
                )
        return self

    @property
    def ring_degree(self) -> int:
        return 1 << self.log_ring_degree

    @property
    def slot_count(self) -> int:
        return self.ring_degree // 2

    @property
    def default_scale(self) -> float:
        return float(2**self.scale_bits)

    @property
    def total_modulus_bits(self) -> int:
        return sum(self.scale_prime_bits) + self.base_prime_bits + self.special_prime_bits

    @property
    def q_count(self) -> int:
        return len(self.scale_prime_bits) + 1

    @property
    def max_depth(self) -> int:
        """Deepest public depth: only the base prime and nothing to rescale by remains."""
        return len(self.scale_prime_bits)

    @property
    def special_prime_id(self) -> int:
        return self.q_count

    @cached_property
    def moduli(self) -> tuple[int, ...]:
        """All primes in id order; distinct, each ≡ 1 mod 2N, each just below 2**bits."""
        wanted = (*self.scale_prime_bits, self.base_prime_bits, self.special_prime_bits)
        by_bits: dict[int, list[int]] = {}
        for bits in sorted(set(wanted)):
            by_bits[bits] = ntt_primes(bits, self.ring_degree, wanted.count(bits))
        # Hand out the largest prime of each size to the special slot first, then base, then scale.
        result: list[int] = [0] * len(wanted)
        for index in reversed(range(len(wanted))):
            result[index] = by_bits[wanted[index]].pop(0)
        return tuple(result)

    def q_ids_at(self, depth: int) -> tuple[int, ...]:
        return tuple(range(depth, self.q_count))


class Preset(StrEnum):
    """Named parameter sets: slots, default scale and multiplicative depth."""

    TOY_N1024 = "toy-slots512-scale30-depth2"
    TOY_N2048 = "toy-slots1024-scale30-depth3"
    TOY_N4096 = "toy-slots2048-scale40-depth3"
    SLOTS4096_SCALE40_DEPTH2 = "slots4096-scale40-depth2"
    SLOTS8192_SCALE40_DEPTH4 = "slots8192-scale40-depth4"
    SLOTS16384_SCALE40_DEPTH4 = "slots16384-scale40-depth4"
    SLOTS16384_SCALE40_DEPTH16 = "slots16384-scale40-depth16"
    SLOTS32768_SCALE40_DEPTH32 = "slots32768-scale40-depth32"


_PRESETS: dict[Preset, dict[str, object]] = {
    Preset.TOY_N1024: {
        "log_ring_degree": 10,
        "scale_bits": 30,
        "scale_prime_bits": (30, 30),
        "base_prime_bits": 40,
        "special_prime_bits": 40,
        "enforce_security": False,
    },
    Preset.TOY_N2048: {
        "log_ring_degree": 11,
        "scale_bits": 30,
        "scale_prime_bits": (30, 30, 30),
        "base_prime_bits": 40,
        "special_prime_bits": 40,
        "enforce_security": False,
    },
    Preset.TOY_N4096: {
        "log_ring_degree": 12,
        "scale_bits": 40,
        "scale_prime_bits": (40, 40, 40),
        "base_prime_bits": 50,
        "special_prime_bits": 50,
        "enforce_security": False,
    },
    Preset.SLOTS4096_SCALE40_DEPTH2: {
        "log_ring_degree": 13,
        "scale_bits": 40,
        "scale_prime_bits": (40, 40),
        "base_prime_bits": 48,
        "special_prime_bits": 50,
    },
    Preset.SLOTS8192_SCALE40_DEPTH4: {
        "log_ring_degree": 14,
        "scale_bits": 40,
        "scale_prime_bits": (40,) * 4,
        "base_prime_bits": 48,
        "special_prime_bits": 50,
    },
    Preset.SLOTS16384_SCALE40_DEPTH4: {
        "log_ring_degree": 15,
        "scale_bits": 40,
        "scale_prime_bits": (40,) * 4,
        "base_prime_bits": 48,
        "special_prime_bits": 50,
    },
    Preset.SLOTS16384_SCALE40_DEPTH16: {
        "log_ring_degree": 15,
        "scale_bits": 40,
        "scale_prime_bits": (40,) * 16,
        "base_prime_bits": 48,
        "special_prime_bits": 50,
    },
    Preset.SLOTS32768_SCALE40_DEPTH32: {
        "log_ring_degree": 16,
        "scale_bits": 40,
        "scale_prime_bits": (40,) * 32,
        "base_prime_bits": 48,
        "special_prime_bits": 50,
    },
}


def preset_parameters(preset: Preset | str) -> CkksParameters:
    try:
        member = Preset(preset)
    except ValueError:
        names = ", ".join(p.value for p in Preset)
        raise ValueError(f"unknown CKKS preset {preset!r}; known presets: {names}") from None
    return CkksParameters.model_validate(_PRESETS[member])


__all__ = [
    "ERROR_STANDARD_DEVIATION",
    "MAX_MODULUS_BITS_128",
    "CkksParameters",
    "Preset",
    "preset_parameters",
]
