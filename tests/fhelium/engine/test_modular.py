from __future__ import annotations

import random

import pytest
import torch

from fhelium.engine import modular as mod
from fhelium.engine.primes import ntt_primes


def _operands(q: int, count: int = 2000) -> tuple[list[int], list[int]]:
    rng = random.Random(q)
    edges = [0, 1, q - 1, q - 2, q // 2, q // 2 + 1]
    a = edges + [rng.randrange(q) for _ in range(count)]
    b = list(reversed(edges)) + [rng.randrange(q) for _ in range(count)]
    return a, b


@pytest.mark.parametrize("bits", [20, 31, 40, 45, 50])
def test_kernels_match_python_integers(bits: int) -> None:
    q = ntt_primes(bits, 1024, 1)[0]
    a, b = _operands(q)
    ta, tb = torch.tensor(a), torch.tensor(b)
    qt = torch.tensor([q])
    q_inverse = 1.0 / qt.double()
    assert mod.add_mod(ta, tb, qt).tolist() == [(x + y) % q for x, y in zip(a, b, strict=True)]
    assert mod.sub_mod(ta, tb, qt).tolist() == [(x - y) % q for x, y in zip(a, b, strict=True)]
    assert mod.neg_mod(ta, qt).tolist() == [(-x) % q for x in a]
    assert mod.mul_mod(ta, tb, qt, q_inverse).tolist() == [x * y % q for x, y in zip(a, b, strict=True)]
    w = tb
    w_over_q = w.double() / q
    lazy = ta + q * (ta % 2)  # inputs in [0, 2q)
    expected = [(x + q * (x % 2)) * y % q for x, y in zip(a, b, strict=True)]
    assert mod.mul_mod_shoup(lazy, w, w_over_q, qt).tolist() == expected
    assert mod.center(ta, qt).tolist() == [x - q if x > q // 2 else x for x in a]
    in_place = ta.clone()
    mod.add_mod_(in_place, tb, qt)
    assert in_place.tolist() == [(x + y) % q for x, y in zip(a, b, strict=True)]


def test_add_mod_in_place_on_a_strided_view_touches_only_the_view() -> None:
    q = ntt_primes(40, 1024, 1)[0]
    base = torch.randint(0, q, (4, 3, 8))
    original = base.clone()
    view = base[:, 1:3]
    other = torch.randint(0, q, (4, 2, 8))
    mod.add_mod_(view, other, torch.tensor([q]))
    assert torch.equal(base[:, 0], original[:, 0])
    assert torch.equal(base[:, 1:3], (original[:, 1:3] + other) % q)


@pytest.mark.parametrize("bits", [30, 40, 48, 50])
def test_lazy_signed_kernels_stay_in_bounds_and_are_congruent(bits: int) -> None:
    q = ntt_primes(bits, 1024, 1)[0]
    a, b = _operands(q)
    qt = torch.tensor([q])
    ta, tb = torch.tensor(a), torch.tensor(b)
    signed = mod.mul_mod_signed(ta, tb, qt, 1.0 / qt.double()).tolist()
    assert all(-q < r < q for r in signed)
    assert [r % q for r in signed] == [x * y % q for x, y in zip(a, b, strict=True)]
    # Shoup input anywhere in [-2q, 2q]
    spread = [(x * 7919) % (4 * q + 1) - 2 * q for x in a]
    spread[:4] = [-2 * q, 2 * q, -2 * q + 1, 2 * q - 1]
    lazy = mod.mul_mod_shoup_signed(torch.tensor(spread), tb, tb.double() / q, qt).tolist()
    assert all(-q <= r <= q for r in lazy)
    assert [r % q for r in lazy] == [x * y % q for x, y in zip(spread, b, strict=True)]
    sums = [(x * 31) % (4 * q + 1) - 2 * q for x in a]
    folded = mod.fold_signed_(torch.tensor(sums), qt).tolist()
    assert all(-q <= r <= q for r in folded) and [r % q for r in folded] == [s % q for s in sums]
    boundary = torch.tensor([-q, -1, 0, 1, q - 1, q])
    assert mod.normalize_signed(boundary, qt).tolist() == [0, q - 1, 0, 1, q - 1, 0]
