"""Flooding (smudging) noise from the keystream, in exactly rounded arithmetic.

The reference sampler is Box–Muller on 53-bit uniforms, with the logarithm, sine and cosine
evaluated by fixed polynomials in IEEE binary64 additions, multiplications, one division and one
square root, each a separate correctly rounded operation (no fused multiply-add, no library
transcendental function). ``smudging_noise_reference`` is that reference in torch;
``smudging_noise_from_words`` dispatches to the native kernel where it is available. The result is
a function of the keystream alone, the same on every CPU and every torch build (torch's own
``log``/``cos``/``sin`` go through MKL or SLEEF, whose last bit depends on the CPU path), and the
native kernel (``fhelium.native.smudging_noise``, compiled with ``-ffp-contract=off``) performs the
same operations in the same order, so its output is bit-identical (tested).

Accuracy of the pieces (binary64, relative):

- ``log_unit``: u = m·2^e with m in [√½, √2); log m = 2·atanh(s), s = (m−1)/(m+1), |s| ≤ 0.1716,
  as 2s·Σ_{k≤11} s^{2k}/(2k+1) (truncation below 2^-60); log u = e·ln2_hi + (2s·p + e·ln2_lo) with
  ln2 split so that e·ln2_hi is exact. A few ulp, like a library logarithm.
- ``sincos_turns``: the angle 2π·t is reduced exactly in turns (4t = quadrant + g, g folded to
  [0, ½]), so x = g·π/2 ∈ [0, π/4]; sin x and cos x by their Taylor series to x^19 and x^18
  (truncation below 2^-63). A few ulp.

Errors of a few ulp move a sample by far less than one integer step before rounding except at
a vanishing fraction of half-integer boundaries, as with any library implementation of
Box–Muller; the distribution tests in tests/fhelium/multiparty hold the result to its stated
Gaussian.
"""

from __future__ import annotations

import math

import torch

MANTISSA_MASK = (1 << 52) - 1
EXPONENT_ONE = 1023 << 52
SQRT2 = math.sqrt(2.0)
# ln 2 = LN2_HI + LN2_LO (fdlibm's split): LN2_HI has 21 trailing zero bits, so e·LN2_HI is exact
# for |e| < 2^21
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
# 1/(2k+1), k = 11 .. 1 (Horner order), then 1
LOG_COEFFICIENTS = tuple(1.0 / (2 * k + 1) for k in range(11, 0, -1))
HALF_PI = math.pi / 2.0
# sin x = x + x·z·Σ_{k=1..9} (−1)^k z^(k−1)/(2k+1)!, z = x²  (Horner order: k = 9 .. 1)
SIN_COEFFICIENTS = tuple((-1.0) ** k / math.factorial(2 * k + 1) for k in range(9, 0, -1))
# cos x = 1 + z·Σ_{k=1..9} (−1)^k z^(k−1)/(2k)!  (Horner order: k = 9 .. 1)
COS_COEFFICIENTS = tuple((-1.0) ** k / math.factorial(2 * k) for k in range(9, 0, -1))
UNIFORM_BITS = 53


def _horner(z: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """Σ c_i z^(n−1−i) as ((c_0·z + c_1)·z + …): one multiplication and one addition per step."""
    p = torch.full_like(z, coefficients[0])
    for c in coefficients[1:]:
        p.mul_(z).add_(c)
    return p


def log_unit(u: torch.Tensor) -> torch.Tensor:
    """Natural logarithm of normal positive binary64 ``u`` (exactly rounded steps; see the module)."""
    if u.dtype != torch.float64:
        raise ValueError(f"log_unit needs float64; got {u.dtype}")
    bits = u.view(torch.int64)
    exponent = (bits >> 52) - 1023
    m = ((bits & MANTISSA_MASK) | EXPONENT_ONE).view(torch.float64)  # [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)  # [√½, √2), exact
    e = (exponent + big.long()).double()
    f = m - 1.0  # exact (Sterbenz)
    s = f / (m + 1.0)
    p = _horner(s * s, (*LOG_COEFFICIENTS, 1.0))
    tail = (s * 2.0).mul_(p).add_(e * LN2_LO)
    return (e * LN2_HI).add_(tail)


def sincos_turns(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin 2πt, cos 2πt) for binary64 ``t`` in [0, 1) (exactly rounded steps; see the module)."""
    t4 = t * 4.0  # exact
    quadrant = t4.floor()
    g = t4 - quadrant  # exact
    flip = g > 0.5
    x = torch.where(flip, 1.0 - g, g).mul_(HALF_PI)  # 1 − g exact for g in [½, 1)
    z = x * x
    sin_x = (x * z).mul_(_horner(z, SIN_COEFFICIENTS)).add_(x)
    cos_x = z.mul(_horner(z, COS_COEFFICIENTS)).add_(1.0)
    sin_phi = torch.where(flip, cos_x, sin_x)  # φ = (π/2)·g
    cos_phi = torch.where(flip, sin_x, cos_x)
    q = quadrant.long()
    odd = (q & 1).bool()
    sine = torch.where(odd, cos_phi, sin_phi)
    cosine = torch.where(odd, sin_phi, cos_phi)
    sine = torch.where(q >= 2, -sine, sine)
    cosine = torch.where((q == 1) | (q == 2), -cosine, cosine)
    return sine, cosine


def noise_constants() -> torch.Tensor:
    """The constants the native kernel takes, in its order (never retyped in C++)."""
    return torch.tensor(
        [LN2_HI, LN2_LO, SQRT2, HALF_PI, *LOG_COEFFICIENTS, 1.0, *SIN_COEFFICIENTS, *COS_COEFFICIENTS],
        dtype=torch.float64,
    )


_CONSTANTS: list[torch.Tensor] = []


def _native_level() -> str:
    from fhelium import native  # imported here: fhelium.native imports nothing of the engine

    return native.elementwise_level()


def smudging_noise_from_words(
    words: torch.Tensor, shift_bits: int, high_sigma: float, low_sigma: float, *, native: bool | None = None
) -> torch.Tensor:
    """Flooding noise 2^shift·Y1 + Y2 (int64 ``[count]``) from ``2·count`` 63-bit keystream words.

    The native kernel when it is available (``native`` None: unless ``FHELIUM_NATIVE_LEVEL=torch``),
    else the pure-torch reference (``smudging_noise_reference``): the same bits either way.
    """
    use_native = _native_level() != "torch" if native is None else native
    if not use_native or words.device.type != "cpu":
        return smudging_noise_reference(words, shift_bits, high_sigma, low_sigma)
    from fhelium import native as kernels

    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() % 2:
        raise ValueError("smudging noise needs an even number of int64 words")
    if not _CONSTANTS:
        _CONSTANTS.append(noise_constants())
    return kernels.smudging_noise(words, _CONSTANTS[0], shift_bits, high_sigma, low_sigma)


def smudging_noise_reference(
    words: torch.Tensor, shift_bits: int, high_sigma: float, low_sigma: float
) -> torch.Tensor:
    """Flooding noise 2^shift·Y1 + Y2 (int64 ``[count]``) from ``2·count`` 63-bit keystream words.

    Word i < count gives the radius uniform u1, word count + i the angle uniform u2, each
    (w >> 10 + ½)·2^-53 in (0, 1); r = √(−2·ln u1), Y1 = round(cos(2πu2)·r·σ_high),
    Y2 = round(sin(2πu2)·r·σ_low) (half to even). The largest radius is √(2·ln 2^54) ≈ 8.66 σ.
    """
    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() % 2:
        raise ValueError("smudging noise needs an even number of int64 words")
    count = words.numel() // 2
    uniform = (words >> (63 - UNIFORM_BITS)).double().add_(0.5).mul_(2.0**-UNIFORM_BITS)
    radius = log_unit(uniform[:count]).mul_(-2.0).sqrt_()
    sine, cosine = sincos_turns(uniform[count:])
    high = cosine.mul_(radius).mul_(high_sigma).round_().long()
    low = sine.mul_(radius).mul_(low_sigma).round_().long()
    return high.bitwise_left_shift_(shift_bits).add_(low)


__all__ = [
    "log_unit",
    "noise_constants",
    "sincos_turns",
    "smudging_noise_from_words",
    "smudging_noise_reference",
]
