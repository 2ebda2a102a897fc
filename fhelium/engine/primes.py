"""NTT-friendly prime generation: primes q ≡ 1 (mod 2N) and their primitive 2N-th roots of unity."""

from __future__ import annotations

from collections.abc import Iterable

# Deterministic Miller–Rabin witnesses: exact for every n < 3.3e24 (covers all 64-bit inputs).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def ntt_primes(bits: int, ring_degree: int, count: int, *, exclude: Iterable[int] = ()) -> list[int]:
    """``count`` distinct primes q ≡ 1 (mod 2N) just below 2**bits, largest first.

    Primes just below a power of two make uniform sampling by masking almost rejection-free.
    """
    step = 2 * ring_degree
    excluded = set(exclude)
    found: list[int] = []
    candidate = ((1 << bits) - 1) // step * step + 1
    lower = 1 << (bits - 1)
    while len(found) < count:
        if candidate < lower:
            raise ValueError(
                f"only {len(found)} NTT-friendly {bits}-bit primes exist for N={ring_degree}; "
                f"{count} requested — use more bits or a smaller ring"
            )
        if candidate not in excluded and is_prime(candidate):
            found.append(candidate)
        candidate -= step
    return found


def primitive_root_of_unity(order: int, modulus: int) -> int:
    """The smallest-generator primitive ``order``-th root of unity mod a prime (order | q-1)."""
    if (modulus - 1) % order:
        raise ValueError(f"{modulus} has no primitive {order}-th root of unity ({order} does not divide q-1)")
    # order is a power of two here, so ω is primitive iff ω^(order/2) = -1.
    for g in range(2, modulus):
        root = pow(g, (modulus - 1) // order, modulus)
        if pow(root, order // 2, modulus) == modulus - 1:
            return root
    raise ValueError(f"no primitive {order}-th root of unity mod {modulus}")


__all__ = ["is_prime", "ntt_primes", "primitive_root_of_unity"]
