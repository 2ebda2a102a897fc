"""The flooding-noise sampler (fhelium.multiparty.noise): its exactly rounded reference, its known
answers, and the native kernel's bit-identity with it at every dispatch level (issue 16).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from fhelium import native
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty import smudging_noise
from fhelium.multiparty.noise import (
    log_unit,
    noise_constants,
    sincos_turns,
    smudging_noise_from_words,
    smudging_noise_reference,
)
from fhelium.multiparty.parameters import THRESHOLD_AGGREGATION

PARAMS = THRESHOLD_AGGREGATION
ARGS = (PARAMS.smudging_shift_bits, PARAMS.smudging_high_sigma, PARAMS.smudging_low_sigma)


def _native_levels() -> list[str]:
    if not native.load():
        if os.environ.get(native.REQUIRE_ENVIRONMENT_VARIABLE) == "1":
            pytest.fail("FHELIUM_REQUIRE_NATIVE=1 but the native extension is unavailable")
        pytest.skip("fhelium native extension unavailable (no C++ compiler?)")
    return list(native.supported_levels()) or ["scalar"]


def _edge_words() -> torch.Tensor:
    """Words at the uniforms' edges: k = w >> 10 at 0, 2^52 ± 1, 2^53 − 1 (u rounds to 1), the
    mantissa split at √2, and angle words at every quadrant boundary and the fold point g = ½.
    """
    k = [0, 1, 2, (1 << 52) - 1, 1 << 52, (1 << 52) + 1, (1 << 53) - 2, (1 << 53) - 1]
    k += [int(math.sqrt(0.5) * 2**53) + d for d in (-2, -1, 0, 1, 2)]
    k += [(j << 51) + d for j in range(8) for d in (-1, 0, 1) if 0 <= (j << 51) + d < 1 << 53]
    k += [(3 << 50) + d for d in (-1, 0, 1)] + [(1 << 53) - (1 << 49) + d for d in (-1, 0, 1)]
    radius = torch.tensor(k, dtype=torch.int64)
    angle = torch.tensor(list(reversed(k)), dtype=torch.int64)
    low_bits = torch.arange(len(k), dtype=torch.int64) * 37 % 1024  # the 10 bits the sampler drops
    return torch.cat(((radius << 10) | low_bits, (angle << 10) | low_bits.flip(0)))


def test_reference_log_and_sincos_agree_with_library_functions_to_a_few_ulp() -> None:
    generator = torch.Generator().manual_seed(5)
    u = torch.cat(
        (
            torch.rand(1 << 16, dtype=torch.float64, generator=generator),
            torch.tensor(
                [2.0**-54, 2.0**-53, 0.5, math.sqrt(0.5), math.sqrt(0.5) + 2**-53, 1 - 2**-53, 1.0],
                dtype=torch.float64,
            ),
        )
    ).clamp_min_(2.0**-60)
    logs = log_unit(u)
    assert float(((logs - torch.log(u)).abs() / torch.log(u).abs().clamp_min(1e-300)).max()) < 2e-15
    assert float(log_unit(torch.tensor([1.0], dtype=torch.float64))[0]) == 0.0
    sine, cosine = sincos_turns(u.clamp(max=1 - 2**-53))
    angle = (2 * math.pi) * u.clamp(max=1 - 2**-53)
    # the library side rounds 2πt first (up to half an ulp of 2π); the reference reduces t exactly
    assert float((sine - torch.sin(angle)).abs().max()) < 2e-15
    assert float((cosine - torch.cos(angle)).abs().max()) < 2e-15
    quarter = torch.tensor([0.0, 0.125, 0.25, 0.5, 0.75], dtype=torch.float64)
    sine, cosine = sincos_turns(quarter)
    assert sine.tolist() == pytest.approx([0.0, math.sqrt(0.5), 1.0, 0.0, -1.0], abs=3e-16)
    assert cosine.tolist() == pytest.approx([1.0, math.sqrt(0.5), 0.0, -1.0, 0.0], abs=3e-16)


def test_reference_noise_known_answers() -> None:
    """Pinned outputs (the sampler is a function of the keystream alone: no library transcendental),
    and agreement with the same Box–Muller written with Python's math module (libm) within one unit.
    """
    words = RandomSource(7, purpose="smudging").words(8)
    assert smudging_noise_reference(words, *ARGS).tolist() == [
        -144085505556245274,
        -149422038842706196,
        17378148330403035,
        -22326599050390489,
    ]
    words = RandomSource(8, purpose="smudging").words(2 * 64)
    noise = smudging_noise_reference(words, *ARGS).tolist()
    for i, value in enumerate(noise):
        u1 = (float(int(words[i]) >> 10) + 0.5) * 2.0**-53
        u2 = (float(int(words[64 + i]) >> 10) + 0.5) * 2.0**-53
        radius = math.sqrt(-2.0 * math.log(u1))
        high = round(math.cos(2 * math.pi * u2) * radius * ARGS[1])
        low = round(math.sin(2 * math.pi * u2) * radius * ARGS[2])
        assert abs(value - ((high << ARGS[0]) + low)) <= 1, i


def test_smudging_noise_draws_its_words_from_the_source() -> None:
    source = RandomSource(11, purpose="smudging")
    again = RandomSource(11, purpose="smudging")
    first = smudging_noise(source, 1000, PARAMS)
    assert torch.equal(first, smudging_noise_reference(again.words(2000), *ARGS))
    second = smudging_noise(source, 1000, PARAMS)  # a fresh draw (next nonce), not a repeat
    assert not torch.equal(first, second)


@pytest.mark.parametrize("count", [1, 7, 8, 9, 4096 + 5, 1 << 15])
def test_native_noise_is_bit_identical_to_the_reference_at_every_level(count: int) -> None:
    levels = _native_levels()
    for seed in (1, 2, 3):
        words = RandomSource(seed, purpose="smudging").words(2 * count)
        reference = smudging_noise_reference(words, *ARGS)
        for level in levels:
            out = native.smudging_noise(words, noise_constants(), *ARGS, level=level)
            assert out.dtype == torch.int64 and out.shape == (count,)
            assert torch.equal(out, reference), (level, seed, int((out != reference).sum()))


def test_native_noise_is_bit_identical_on_edge_words_and_other_parameters() -> None:
    levels = _native_levels()
    words = _edge_words()
    for args in (ARGS, (0, 1.0, 1.0), (20, 2.0**30, 2.0**43), (37, 3.5, 1e6)):
        reference = smudging_noise_reference(words, *args)
        for level in levels:
            out = native.smudging_noise(words, noise_constants(), *args, level=level)
            assert torch.equal(out, reference), (level, args, (out != reference).nonzero().flatten().tolist())


def test_dispatch_uses_the_native_kernel_unless_the_level_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_levels()
    monkeypatch.delenv(native.LEVEL_ENVIRONMENT_VARIABLE, raising=False)
    words = RandomSource(4, purpose="smudging").words(2 * 100)
    calls: list[int] = []
    real = native.smudging_noise

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "smudging_noise", counting)
    native_out = smudging_noise_from_words(words, *ARGS)
    assert calls == [1]
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
    torch_out = smudging_noise_from_words(words, *ARGS)
    assert calls == [1] and torch.equal(native_out, torch_out)


def test_malformed_words_are_refused() -> None:
    for words in (torch.zeros(3, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(4)):
        with pytest.raises(ValueError, match="even number of int64 words"):
            smudging_noise_reference(words, *ARGS)
        with pytest.raises(ValueError, match="even number of int64 words"):
            smudging_noise_from_words(words, *ARGS, native=native.load())


def test_native_signed_ntt_equals_reduce_signed_then_the_ntt(monkeypatch: pytest.MonkeyPatch) -> None:
    from fhelium.engine.ntt import NegacyclicNtt
    from fhelium.multiparty import ThresholdParty
    from fhelium.multiparty.encoding import reduce_signed
    from fhelium.multiparty.protocol import noise_to_ntt

    levels = _native_levels()
    monkeypatch.delenv(native.LEVEL_ENVIRONMENT_VARIABLE, raising=False)
    engine = ThresholdParty(0, 1, rng_seed=3).engine
    ids = engine.q_ids_at(0)
    n = engine.ring_degree
    q = engine._mod(ids)
    torch_ntt = NegacyclicNtt(n, list(engine.moduli), torch.device("cpu"), native=False)
    noise = smudging_noise(RandomSource(9, purpose="smudging"), 3 * n, PARAMS).view(3, n)
    edges = torch.tensor([0, 1, -1, (1 << 62) - 1, -(1 << 62), *q.q.flatten().tolist()], dtype=torch.int64)
    noise[0, : edges.numel()] = edges
    noise[1, : edges.numel()] = -edges.clamp(min=-(1 << 62) + 1)
    reference = torch_ntt.forward(reduce_signed(noise.unsqueeze(-2), q.q, q.q_inverse), ids)
    for level in levels:
        tables = engine.ntt._native_tables(ids)
        assert torch.equal(native.signed_ntt(noise, *tables, level), reference), level
    assert torch.equal(noise_to_ntt(engine, noise, ids), reference)
    with pytest.raises(RuntimeError, match="below 2\\^62"):
        native.signed_ntt(torch.full((1, n), 1 << 62), *engine.ntt._native_tables(ids), levels[0])


def test_the_new_ops_have_fake_implementations() -> None:
    levels = _native_levels()
    level = native.LEVEL_CODES[levels[-1]]
    words = RandomSource(12, purpose="smudging").words(2 * 64)
    torch.library.opcheck(torch.ops.fhelium.smudging_noise.default, (words, noise_constants(), *ARGS, level))
    n = 64
    from fhelium.engine.primes import ntt_primes, primitive_root_of_unity

    moduli = ntt_primes(50, n, 2)
    q, tables = native.ntt_tables(moduli, [primitive_root_of_unity(2 * n, p) for p in moduli], n)
    noise = smudging_noise_reference(RandomSource(13, purpose="smudging").words(2 * 2 * n), *ARGS).view(2, n)
    torch.library.opcheck(torch.ops.fhelium.signed_ntt.default, (noise, q, tables, level))
