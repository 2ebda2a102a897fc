"""Threshold (N-out-of-N) CKKS parameters for encrypted aggregation, and the derivation behind them.

Every number here is explained in docs/fhelium-multiparty.md; the functions recompute it so the
tests (and ``ThresholdParameters.check``) can hold the preset to its claims.

Noise flooding. The sum ciphertext's noise ``e`` (encryption noise of every party; it depends on
the secret, which is what Li and Micciancio's key-recovery attack on approximate decryption
exploits, EUROCRYPT 2021) is hidden in each decryption share by fresh Gaussian noise of standard
deviation ``sigma``. For Gaussians, KL(N(e, σ²I) ‖ N(0, σ²I)) = ‖e‖²/(2σ²), so by Pinsker the
statistical distance of a share from one that does not depend on ``e`` is at most ‖e‖₂/(2σ).
Statistical security λ per decryption therefore needs σ ≥ ‖e‖₂ · 2^(λ-1), and every party must
meet it alone (the others may collude).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fhelium.engine.parameters import ERROR_STANDARD_DEVIATION, MAX_MODULUS_BITS_128, CkksParameters

# N = 2^13, Q = two 50-bit primes, P = one 50-bit prime: 150 bits of Q·P, within the 218-bit
# limit for 128-bit security at N = 2^13 (HomomorphicEncryption.org standard, ternary secret; the
# collective secret Σ s_i is not ternary, but it is a sum of independent ternary secrets and
# RLWE with a wider secret is no easier). scale_bits is the engine's low encoding scale (see
# ``encode_scale_bits``).
THRESHOLD_CKKS_PARAMETERS = CkksParameters(
    log_ring_degree=13, scale_bits=44, scale_prime_bits=(50,), base_prime_bits=50, special_prime_bits=50
)


def fresh_noise_variance(ring_degree: int, parties: int) -> float:
    """Per-coefficient variance of one fresh public-key encryption under a collective key.

    The engine encrypts over Q·P and divides by P: what is left is e0 (σ = 3.19), the rounding r0
    (uniform in [-1/2, 1/2]) and r1·s, with r1 uniform rounding and s = Σ of ``parties`` ternary
    secrets (variance 2·parties/3 per coefficient); the (u·e + e1·s)/P terms are below 2^-30.
    """
    secret_variance = 2.0 * parties / 3.0
    return ERROR_STANDARD_DEVIATION**2 + 1.0 / 12.0 + ring_degree * secret_variance / 12.0


def aggregate_noise_l2_bound(ring_degree: int, parties: int) -> float:
    """A bound on ‖e‖₂ of the sum of ``parties`` fresh encryptions: twice its expectation.

    ‖e‖₂² is a sum of N nearly independent terms, so it concentrates within a few percent of its
    mean; the factor 2 is margin.
    """
    return 2.0 * math.sqrt(ring_degree * parties * fresh_noise_variance(ring_degree, parties))


def required_smudging_sigma(ring_degree: int, parties: int, statistical_security: int) -> float:
    """σ with ‖e‖₂/(2σ) ≤ 2^-λ (Pinsker on the Gaussian KL divergence; see the module docstring)."""
    return aggregate_noise_l2_bound(ring_degree, parties) * 2.0 ** (statistical_security - 1)


def expected_max_mean_error(
    ring_degree: int, parties: int, sigma: float, scale: float, values: int, *, decryptors: int | None = None
) -> float:
    """Expected largest |error| of the decrypted mean over ``values`` real slots.

    Σ of ``decryptors`` shares' flooding noise (default: ``parties``, N-out-of-N) has per-coefficient
    std √decryptors·σ; a slot is a sum of N coefficients times unit roots, so its real part has std
    √(N/2)·√decryptors·σ/Δ, and the mean divides by ``parties`` (the contributors). The largest of
    ``values`` Gaussians is about √(2 ln(2·values)) std. t-out-of-N: the active set A decrypts the
    contributors' sum; each share is λ_j·sk_j·c1 + e_j with the flooding noise drawn *after* the
    Lagrange scaling, so the coefficients multiply the (exact) Shamir share, not the noise, and only
    |A| floods reach the result.
    """
    floods = parties if decryptors is None else decryptors
    slot_std = math.sqrt(ring_degree / 2.0) * math.sqrt(floods) * sigma / scale / parties
    return math.sqrt(2.0 * math.log(2.0 * max(values, 1))) * slot_std


@dataclass(frozen=True)
class ThresholdParameters:
    """A CKKS ring plus the threshold protocol's message scale and flooding noise.

    The flooding noise is sampled as ``2^shift_bits · Y1 + Y2`` with Y1, Y2 rounded Gaussians of
    standard deviations ``smudging_high_sigma`` and ``smudging_low_sigma``: float64 Box–Muller keeps
    integer resolution only up to about 2^50, and Y2 (std 2^40 = 8·2^shift_bits) smooths the
    gaps of the shifted Y1 (Peikert's convolution, CRYPTO 2010; Micciancio–Walter, CRYPTO 2017;
    see docs/fhelium-multiparty.md). The sum is Gaussian with
    σ² = 2^(2·shift_bits)·σ_high² + σ_low².
    """

    ckks: CkksParameters = THRESHOLD_CKKS_PARAMETERS
    message_scale_bits: int = 88
    encode_scale_bits: int = 44
    statistical_security: int = 40
    max_parties: int = 64
    smudging_shift_bits: int = 37
    smudging_high_sigma: float = 2.0**20
    smudging_low_sigma: float = 2.0**40
    # Decrypted ciphertext rows (decryption shares published) per key share before the party refuses:
    # each row spends at most 2^-statistical_security of statistical distance, so 2^20 rows bound a
    # key's total to 2^-20 (docs/fhelium-multiparty.md, "Flooding budget").
    decryption_row_budget: int = 2**20

    @property
    def message_scale(self) -> float:
        return float(2**self.message_scale_bits)

    @property
    def smudging_sigma(self) -> float:
        high = 2.0**self.smudging_shift_bits * self.smudging_high_sigma
        return math.sqrt(high * high + self.smudging_low_sigma**2)

    @property
    def q_bits(self) -> int:
        return sum(self.ckks.scale_prime_bits) + self.ckks.base_prime_bits

    def headroom(self, moduli: tuple[int, ...] | None = None) -> float:
        """Largest |sum| a slot holds: Q/2 over the message scale (Q = product of the Q primes)."""
        primes = (moduli or self.ckks.moduli)[: self.ckks.q_count]
        return math.prod(primes) / 2.0 / self.message_scale

    def check(self) -> None:
        """Raise ValueError unless security, flooding and headroom hold for ``max_parties``."""
        limit = MAX_MODULUS_BITS_128.get(self.ckks.log_ring_degree)
        if not self.ckks.enforce_security or limit is None or self.ckks.total_modulus_bits > limit:
            raise ValueError(f"threshold parameters must keep 128-bit security (Q·P ≤ {limit} bits)")
        if self.encode_scale_bits != self.ckks.scale_bits or self.encode_scale_bits > self.message_scale_bits:
            raise ValueError(
                "encode_scale_bits must equal the engine's scale_bits and not exceed message_scale_bits"
            )
        needed = required_smudging_sigma(self.ckks.ring_degree, self.max_parties, self.statistical_security)
        if self.smudging_sigma < needed:
            raise ValueError(
                f"flooding σ = 2^{math.log2(self.smudging_sigma):.2f} is below the 2^{math.log2(needed):.2f} "
                f"that {self.statistical_security}-bit statistical security needs for {self.max_parties} "
                "parties"
            )
        # the low component must smooth the lattice 2^shift·Z the high one lives on (η ≈ 1.9 std for ε =
        # 2^-100)
        if self.smudging_low_sigma < 4.0 * 2.0**self.smudging_shift_bits:
            raise ValueError("smudging_low_sigma must be at least 4·2^smudging_shift_bits")
        if self.smudging_low_sigma > 2.0**44 or self.smudging_high_sigma > 2.0**44:
            raise ValueError("each Gaussian component must stay below 2^44 (float64 integer resolution)")
        flood_peak = 9.0 * self.smudging_sigma * math.sqrt(self.max_parties)
        if self.headroom() * self.message_scale <= flood_peak + self.max_parties * self.message_scale:
            raise ValueError("Q cannot hold max_parties values of magnitude 1 plus the flooding noise")


THRESHOLD_AGGREGATION = ThresholdParameters()

__all__ = [
    "THRESHOLD_AGGREGATION",
    "THRESHOLD_CKKS_PARAMETERS",
    "ThresholdParameters",
    "aggregate_noise_l2_bound",
    "expected_max_mean_error",
    "fresh_noise_variance",
    "required_smudging_sigma",
]
