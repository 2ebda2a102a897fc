"""Python big-integer reference arithmetic for checking the RNS kernels exactly on tiny rings."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def crt(residues: Sequence[int], moduli: Sequence[int]) -> int:
    """The integer in [0, prod(moduli)) with the given residues."""
    product = 1
    for q in moduli:
        product *= q
    total = 0
    for r, q in zip(residues, moduli, strict=True):
        partial = product // q
        total += r * partial * pow(partial, -1, q)
    return total % product


def crt_poly(rows: torch.Tensor, moduli: Sequence[int]) -> list[int]:
    """``[rows, N]`` residues → N big integers in [0, Q)."""
    columns = rows.tolist()
    return [crt([row[i] for row in columns], moduli) for i in range(rows.size(-1))]


def centered(value: int, modulus: int) -> int:
    value %= modulus
    return value - modulus if value > modulus // 2 else value


def negacyclic_product(a: Sequence[int], b: Sequence[int], modulus: int) -> list[int]:
    n = len(a)
    out = [0] * n
    for i, x in enumerate(a):
        if x == 0:
            continue
        for j, y in enumerate(b):
            k = i + j
            if k >= n:
                out[k - n] -= x * y
            else:
                out[k] += x * y
    return [v % modulus for v in out]


def galois(poly: Sequence[int], element: int, modulus: int) -> list[int]:
    """X → X^element on a negacyclic polynomial."""
    n = len(poly)
    out = [0] * n
    for i, c in enumerate(poly):
        k = i * element % (2 * n)
        if k >= n:
            out[k - n] -= c
        else:
            out[k] += c
    return [v % modulus for v in out]


def residues_of(poly: Sequence[int], moduli: Sequence[int]) -> torch.Tensor:
    return torch.tensor([[c % q for c in poly] for q in moduli], dtype=torch.int64)
