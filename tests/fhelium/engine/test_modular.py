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


def test_blocked_add_and_sub_on_a_large_batch_match_python_integers() -> None:
    """Batches above the block size take the chunked path: same results, edge residues included."""
    moduli = ntt_primes(50, 1024, 1) + ntt_primes(40, 1024, 2)
    rows, n, batch = len(moduli), 1024, 2 * (2 * mod.ELEMENTWISE_BLOCK_RESIDUES // (3 * 1024) + 1)
    q = torch.tensor(moduli).unsqueeze(-1)
    generator = torch.Generator().manual_seed(11)
    a = (torch.randint(0, 1 << 62, (2, batch, rows, n), generator=generator) % q)
    b = (torch.randint(0, 1 << 62, (2, batch, rows, n), generator=generator) % q)
    a[..., :2] = q - 1  # sums and differences that wrap
    b[..., 1:3] = q - 1
    assert a.numel() > 2 * mod.ELEMENTWISE_BLOCK_RESIDUES
    total, difference = mod.add_mod(a, b, q), mod.sub_mod(a, b, q)
    for index in [(0, 0), (1, batch - 1), (0, batch // 2)]:
        for row, modulus in enumerate(moduli):
            x, y = a[index][row].tolist(), b[index][row].tolist()
            assert total[index][row].tolist() == [(u + v) % modulus for u, v in zip(x, y, strict=True)]
            assert difference[index][row].tolist() == [(u - v) % modulus for u, v in zip(x, y, strict=True)]


@pytest.mark.parametrize("bits", [40, 50])
def test_digit_inner_product_matches_python_integers(bits: int) -> None:
    """Σ_j digit_j·key_j mod q per component, as key switching uses it (3 digits, 2 components)."""
    moduli = ntt_primes(bits, 64, 2)
    n, digits, batch = 16, 3, 2
    q = torch.tensor(moduli).unsqueeze(-1)
    rng = random.Random(bits)
    lifted = [
        [[[rng.randrange(p) for _ in range(n)] for p in moduli] for _ in range(batch)] for _ in range(digits)
    ]
    keys = [[[[rng.randrange(p) for _ in range(n)] for p in moduli]] for _ in range(digits) for _ in range(2)]
    key_tensor = torch.tensor(keys).view(digits, 2, 1, len(moduli), n)
    lifted[0][0][0][:2] = [moduli[0] - 1, moduli[0] - 1]
    key_tensor[:, :, 0, 0, :2] = moduli[0] - 1
    result = mod.digit_inner_product(torch.tensor(lifted), key_tensor, q, 1.0 / q.double())
    assert result.shape == (2, batch, len(moduli), n)
    k = key_tensor.tolist()
    for c in range(2):
        for s in range(batch):
            for r, p in enumerate(moduli):
                expected = [
                    sum(lifted[j][s][r][t] * k[j][c][0][r][t] for j in range(digits)) % p for t in range(n)
                ]
                assert result[c, s, r].tolist() == expected
