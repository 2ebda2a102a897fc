"""Canonical embedding: slot vectors ↔ real polynomial coefficients (pure torch FFT).

Slot j is the polynomial evaluated at ζ^(g^j mod 2N) with ζ = exp(iπ/N) and g = 5, so the
Galois map X → X^(g^r) rotates slots by r. Evaluating at every odd power of ζ is one length-N
FFT of the coefficients twisted by ζ^n.
"""

from __future__ import annotations

import math

import torch

GALOIS_GENERATOR = 5


class SlotEncoder:
    def __init__(self, ring_degree: int) -> None:
        n = ring_degree
        self.ring_degree = n
        self.slot_count = n // 2
        two_n = 2 * n
        exponents = [pow(GALOIS_GENERATOR, j, two_n) for j in range(self.slot_count)]
        # position t of an FFT output holds the evaluation at ζ^(2t+1)
        self.slot_positions = torch.tensor([(e - 1) // 2 for e in exponents], dtype=torch.int64)
        self.conjugate_positions = torch.tensor([(two_n - e - 1) // 2 for e in exponents], dtype=torch.int64)
        angles = torch.arange(n, dtype=torch.float64) * (math.pi / n)
        self.twist = torch.polar(torch.ones(n, dtype=torch.float64), angles)
        self._cos_over_n = torch.cos(angles) / n
        self._sin_over_n = torch.sin(angles) / n

    def slots_to_coefficients(self, slots: torch.Tensor) -> torch.Tensor:
        """``[*batch, S]`` complex/real slots → ``[*batch, N]`` real float64 coefficients."""
        if not slots.is_complex():
            return self._real_slots_to_coefficients(slots)
        values = slots.to(torch.complex128)
        evaluations = torch.zeros(*values.shape[:-1], self.ring_degree, dtype=torch.complex128)
        evaluations[..., self.slot_positions] = values
        evaluations[..., self.conjugate_positions] = values.conj()
        twisted = torch.fft.fft(evaluations, dim=-1) / self.ring_degree
        real: torch.Tensor = (twisted * self.twist.conj()).real
        return real

    def _real_slots_to_coefficients(self, slots: torch.Tensor) -> torch.Tensor:
        """Real slots give a real evaluation vector, so a half-length real FFT suffices.

        FFT outputs k > N/2 are the conjugates of outputs N - k; with F = fft(E), the result
        Re(F · conj(twist)) / N is Re(F)·cos/N + Im(F)·sin/N.
        """
        values = slots.to(torch.float64)
        n = self.ring_degree
        evaluations = torch.zeros(*values.shape[:-1], n, dtype=torch.float64)
        evaluations[..., self.slot_positions] = values
        evaluations[..., self.conjugate_positions] = values
        half = torch.fft.rfft(evaluations, dim=-1)
        mirrored = half[..., 1 : n // 2].flip(-1)
        re = torch.cat((half.real, mirrored.real), dim=-1)
        im = torch.cat((half.imag, mirrored.imag.neg()), dim=-1)
        return re.mul_(self._cos_over_n).addcmul_(im, self._sin_over_n)

    def coefficients_to_slots(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``[*batch, N]`` real coefficients → ``[*batch, S]`` complex slots."""
        twisted = coefficients.to(torch.complex128) * self.twist
        evaluations = torch.fft.ifft(twisted, dim=-1) * self.ring_degree
        slots: torch.Tensor = evaluations[..., self.slot_positions]
        return slots

    def rotation_galois_element(self, step: int) -> int:
        """Galois element that maps slot vector m to ``torch.roll(m, step)``."""
        return pow(GALOIS_GENERATOR, (-step) % self.slot_count, 2 * self.ring_degree)

    @property
    def conjugation_galois_element(self) -> int:
        return 2 * self.ring_degree - 1


__all__ = ["GALOIS_GENERATOR", "SlotEncoder"]
