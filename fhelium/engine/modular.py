"""Exact modular arithmetic on int64 tensors for primes below 2**50.

Residue rows broadcast against per-row moduli shaped ``[rows, 1]``. Products of two residues
(up to 2**100) do not fit int64, so the quotient is estimated in binary64 and the remainder is
computed with wrapping int64 arithmetic: the true remainder is small, so the wrap is harmless.
With q < 2**50 the binary64 quotient estimate is within one of the exact floor, so one
correction in each direction makes the result exact.

Conditional corrections use the sign bit (``x + ((x >> 63) & q)``) rather than ``torch.where``:
on CPU the shift/and/add chain is several times faster (measured, see
docs/fhelium-performance.md).
"""

from __future__ import annotations

import torch

MAX_PRIME_BITS = 50


def _add_q_if_negative_(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return x.add_(torch.bitwise_and(x >> 63, q))


def reduce_once(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Map x in [0, 2q) to [0, q) (new tensor)."""
    return _add_q_if_negative_(x - q, q)


def correct(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Map r in [-q, 2q) to [0, q); r is consumed (modified in place)."""
    _add_q_if_negative_(r, q)
    return _add_q_if_negative_(r.sub_(q), q)


ELEMENTWISE_BLOCK_RESIDUES = 1 << 16


def _blocked(
    a: torch.Tensor, b: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None:
    """A new result tensor and its cache-sized (result, a, b) chunks, for a large same-shape
    operation with per-row moduli; None for anything else (then one pass is as good).

    A batch of ciphertexts streamed through three passes with full-size temporaries measured
    ~2x slower per ciphertext than the same passes on chunks that stay in cache (B=32, N=2**14).
    """
    if a.dim() < 3 or a.shape != b.shape or a.numel() <= 2 * ELEMENTWISE_BLOCK_RESIDUES:
        return None
    if q.dim() != 2 or q.size(0) != a.size(-2) or q.size(1) != 1:
        return None
    per = max(1, ELEMENTWISE_BLOCK_RESIDUES // (a.size(-2) * a.size(-1)))
    shape = (-1, a.size(-2), a.size(-1))
    result = torch.empty_like(a, memory_format=torch.contiguous_format)
    chunks = zip(
        torch.split(result.view(shape), per),
        torch.split(a.reshape(shape), per),
        torch.split(b.reshape(shape), per),
        strict=True,
    )
    return result, list(chunks)


def add_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if _native_elementwise(a, b, q):
        from fhelium import native

        return native.add_mod(a, b, q)
    blocked = _blocked(a, b, q)
    if blocked is None:
        return _add_q_if_negative_((a + b).sub_(q), q)
    result, chunks = blocked
    for out, a_part, b_part in chunks:
        _add_q_if_negative_(torch.add(a_part, b_part, out=out).sub_(q), q)
    return result


def add_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """In-place ``a = (a + b) mod q``; works on strided views (writes only a's elements)."""
    if _native_elementwise(a, b, q):
        from fhelium import native

        return native.add_mod_(a, b, q)
    a.add_(b).sub_(q)
    return _add_q_if_negative_(a, q)


def sub_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if _native_elementwise(a, b, q):
        from fhelium import native

        return native.sub_mod(a, b, q)
    blocked = _blocked(a, b, q)
    if blocked is None:
        return _add_q_if_negative_(a - b, q)
    result, chunks = blocked
    for out, a_part, b_part in chunks:
        _add_q_if_negative_(torch.sub(a_part, b_part, out=out), q)
    return result


def sub_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if _native_elementwise(a, b, q):
        from fhelium import native

        return native.sub_mod_(a, b, q)
    return _add_q_if_negative_(a.sub_(b), q)


def neg_mod(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # q - 0 = q must map back to 0
    return reduce_once(q - a, q)


def _native_elementwise(*tensors: torch.Tensor) -> bool:
    """Whether the native elementwise ops (``fhelium.native``) serve these operands: int64 CPU
    tensors, the extension available and ``FHELIUM_NATIVE_LEVEL`` not ``torch``.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.device.type != "cpu":
            return False
    from fhelium import native  # imported here: fhelium.native imports nothing of the engine

    return native.elementwise_level() != "torch"


def mul_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor) -> torch.Tensor:
    """(a·b) mod q for a, b in [0, q); ``q_inverse`` is 1/q in float64, shaped like q.

    On CPU the native op computes the same estimate and corrections in one pass (same bits).
    """
    if _native_elementwise(a, b, q):
        from fhelium import native

        return native.mul_mod(a, b, q)
    # a, b >= 0, so truncation toward zero is the floor of the estimate.
    estimate = (a.double() * b.double()).mul_(q_inverse).long()
    return correct((a * b).sub_(estimate.mul_(q)), q)


def mul_mod_shoup(a: torch.Tensor, w: torch.Tensor, w_over_q: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(a·w) mod q for a in [0, 2q), with precomputed ``w_over_q = w/q`` (float64)."""
    estimate = a.double().mul_(w_over_q).long()
    return correct((a * w).sub_(estimate.mul_(q)), q)


def mul_mod_shoup_signed(
    a: torch.Tensor, w: torch.Tensor, w_over_q: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """Lazy (a·w) mod q for |a| <= 2q, w in [0, q): result in [-q, q], **consumes a**.

    The binary64 quotient estimate is rounded to nearest, so no correction is needed: with
    |a·w/q| < 2**51 the estimate error is at most 1/2, hence |a·w − round(est)·q| <= q.
    """
    estimate = a.double().mul_(w_over_q).round_().long()
    return a.mul_(w).sub_(estimate.mul_(q))


def mul_mod_signed(
    a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor
) -> torch.Tensor:
    """Lazy (a·b) mod q for a, b in [0, q): result in (-q, q) (rounded binary64 quotient)."""
    estimate = (a.double() * b.double()).mul_(q_inverse).round_().long()
    return (a * b).sub_(estimate.mul_(q))


def digit_inner_product(
    digits: torch.Tensor, keys: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor
) -> torch.Tensor:
    """Σ_j digits[j]·keys[j] mod q: ``[J, B, R, N]`` × ``[J, C, 1, R, N]`` → ``[C, B, R, N]`` in [0, q).

    Products are lazy (in (-q, q)), summed in int64 (J·q stays far below 2**63) and reduced once.
    One function so that torch.compile can fuse it into a single loop (fhelium.engine.compiled).
    """
    return torch.remainder(mul_mod_signed(digits.unsqueeze(1), keys, q, q_inverse).sum(dim=0), q)


def fold_signed_(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Map x in [-2q, 2q] into [-q, q] in place (x − sign(x)·q)."""
    return x.sub_(torch.sign(x).mul_(q))


def normalize_signed(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Map x in [-q, q] to the standard residue in [0, q) (in place)."""
    _add_q_if_negative_(x, q)
    return _add_q_if_negative_(x.sub_(q), q)


def center(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Signed representative of x in [0, q) within (-q/2, q/2]."""
    half = q // 2
    # x - q where x > q/2: subtract q exactly when (half - x) is negative
    return x - torch.bitwise_and((half - x) >> 63, q)


def reduce_signed(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Residue in [0, q) of any int64 x (exact; uses integer remainder)."""
    return torch.remainder(x, q)


__all__ = [
    "MAX_PRIME_BITS",
    "add_mod",
    "add_mod_",
    "center",
    "correct",
    "digit_inner_product",
    "fold_signed_",
    "mul_mod",
    "mul_mod_shoup",
    "mul_mod_shoup_signed",
    "mul_mod_signed",
    "neg_mod",
    "normalize_signed",
    "reduce_once",
    "reduce_signed",
    "sub_mod",
    "sub_mod_",
]
