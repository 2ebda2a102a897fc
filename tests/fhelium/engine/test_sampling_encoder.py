from __future__ import annotations

import torch

from fhelium.engine import RandomSource
from fhelium.engine.encoder import SlotEncoder


def test_seeded_source_is_deterministic_and_draws_differ() -> None:
    a, b = RandomSource(5), RandomSource(5)
    first = a.words(64)
    assert torch.equal(first, b.words(64))
    assert not torch.equal(first, a.words(64))
    assert not torch.equal(RandomSource(6).words(64), first)


def test_distributions_have_the_promised_support_and_spread() -> None:
    source = RandomSource(7)
    bounds = torch.tensor([[7], [(1 << 40) - 87], [3]])
    values = source.uniform_below(bounds, (3, 20000))
    assert bool((values >= 0).all()) and bool((values < bounds).all())
    assert set(values[0].tolist()) == set(range(7))
    ternary = source.ternary((30000,))
    assert set(ternary.tolist()) == {-1, 0, 1}
    assert abs(float(ternary.double().var()) - 2 / 3) < 0.03
    noise = source.gaussian((30000,), 3.19)
    assert abs(float(noise.double().std()) - 3.19) < 0.1 and int(noise.abs().max()) <= 19


def test_encoder_round_trip_and_galois_rotation() -> None:
    encoder = SlotEncoder(32)
    slots = torch.randn(3, 16, dtype=torch.complex128)
    coefficients = encoder.slots_to_coefficients(slots)
    assert coefficients.dtype == torch.float64
    assert torch.allclose(encoder.coefficients_to_slots(coefficients), slots, atol=1e-12)
    for step in (1, -3, 7):
        element = encoder.rotation_galois_element(step)
        rotated = torch.zeros_like(coefficients)
        for i in range(32):
            k = i * element % 64
            if k >= 32:
                rotated[..., k - 32] -= coefficients[..., i]
            else:
                rotated[..., k] += coefficients[..., i]
        assert torch.allclose(
            encoder.coefficients_to_slots(rotated), torch.roll(slots, step, dims=-1), atol=1e-12
        )


def test_ternary_is_balanced_and_skips_rejected_bytes() -> None:
    source = RandomSource(11)
    draws = source.ternary((3, 40000))
    assert draws.shape == (3, 40000) and draws.dtype == torch.int64
    for value in (-1, 0, 1):
        assert abs(float((draws == value).double().mean()) - 1 / 3) < 0.01
    # Byte 255 would bias `byte % 3` towards 0, so it is skipped and refilled from a new draw.
    streams = iter([bytearray([255, 0, 1, 255, 2] + [255] * 64), bytearray([4, 5] + [0] * 64)])
    rigged = RandomSource(12)
    rigged._bytes = lambda count: next(streams)  # type: ignore[method-assign]
    assert rigged.ternary((5,)).tolist() == [-1, 0, 1, 0, 1]
