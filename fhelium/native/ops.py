"""The native ops as typed Python functions: each forwards to ``torch.ops.fhelium.<name>`` with the
dispatch level's code (``build.LEVEL_CODES``); the elementwise ops default to ``build.elementwise_level()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fhelium.native.build import LEVEL_CODES, NativeUnavailableError, code, load, load_error


def ntt_tables(
    moduli: Sequence[int], roots: Sequence[int], ring_degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(moduli ``[rows]``, tables ``[rows, 4, N]``) for the native NTT; ``roots`` are the ψ per prime."""
    q = torch.tensor(list(moduli), dtype=torch.int64)
    tables = torch.ops.fhelium.ntt_tables(q, torch.tensor(list(roots), dtype=torch.int64), ring_degree)
    return q, tables


def ntt_forward(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    result: torch.Tensor = torch.ops.fhelium.ntt_forward(x, moduli, tables, LEVEL_CODES[level])
    return result


def ntt_inverse(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    result: torch.Tensor = torch.ops.fhelium.ntt_inverse(x, moduli, tables, LEVEL_CODES[level])
    return result


def mul_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a·b) mod q elementwise with broadcasting, a, b in [0, q) (same result as the torch reference).

    ``level``: ``scalar``, ``avx2`` (4 binary64 lanes where a, b < q < 2^50) or ``dq``/``ifma`` (8 lanes of
    AVX-512 DQ at both); None: ``elementwise_level()``.
    """
    result: torch.Tensor = torch.ops.fhelium.mul_mod(a, b, q, code(level))
    return result


def mul_add_mod(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, q: torch.Tensor, level: str | None = None
) -> torch.Tensor:
    """(a·b + c) mod q elementwise with broadcasting, a, b, c in [0, q)."""
    result: torch.Tensor = torch.ops.fhelium.mul_add_mod(a, b, c, q, code(level))
    return result


def project_rows(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_r w[r, l]·x[r, l, n] mod q_l: ``[L, N]`` from ``x [R, L, N]`` and ``w [R, L]``, both in [0, q), exact
    (the sum checks' projection; products summed in 128 bits, reduced once per many rows).
    """
    result: torch.Tensor = torch.ops.fhelium.project_rows(x, w, q)
    return result


def project_rows_checked(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``project_rows`` and whether every residue of ``x`` lies in [0, q_l), from the one pass that reads it
    (the sum checks' range check of a sum, without a pass of its own).
    """
    projection, in_range = torch.ops.fhelium.project_rows_checked(x, w, q)
    return projection, bool(in_range)


def add_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a + b) mod q elementwise with broadcasting, a, b in [0, q) (the torch reference's formula)."""
    result: torch.Tensor = torch.ops.fhelium.add_mod(a, b, q, code(level))
    return result


def sub_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a − b) mod q elementwise with broadcasting, a, b in [0, q)."""
    result: torch.Tensor = torch.ops.fhelium.sub_mod(a, b, q, code(level))
    return result


def add_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """In place ``a = (a + b) mod q`` (a may be a strided view; b and q broadcast to a)."""
    torch.ops.fhelium.add_mod_(a, b, q, code(level))
    return a


def sub_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """In place ``a = (a − b) mod q``."""
    torch.ops.fhelium.sub_mod_(a, b, q, code(level))
    return a


def divide_round(
    x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, drop: int, *, ntt: bool, level: str
) -> torch.Tensor:
    """``[..., R, N]`` → ``[..., R-1, N]``: round(x / q_drop) over the other R-1 primes (row ``drop``
    removed; 0 is a rescale, R-1 a ModDown). ``ntt``: x is in (and the result stays in) the NTT domain.
    """
    result: torch.Tensor = torch.ops.fhelium.divide_round(x, moduli, tables, drop, ntt, LEVEL_CODES[level])
    return result


def mod_down(
    values: torch.Tensor,
    addend: torch.Tensor | None,
    divided: torch.Tensor | None,
    moduli: torch.Tensor,
    tables: torch.Tensor,
    level: str,
    message: torch.Tensor | None = None,
    message_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """ModDown with encryption's extra terms: NTT ``values [..., L+1, N]`` over ``moduli`` (L Q primes,
    then P) → round((values + divided) / P) + addend over the Q primes, NTT domain. ``addend``:
    coefficient-domain residues ``[..., L, N]``; ``divided``: small signed integers ``[..., 1, N]``.
    ``message`` (with ``message_factors`` ``[R, L]``, residues in [0, q_i)): R rows of signed integers
    ``[..., R, N]`` with |x| < 2^62 (moduli above 2^28), added to the addend as Σ_r x_r·f_ri mod q_i.
    ``addend`` and ``message`` may also be shaped like ``values[0]``: then they go into the first
    component only (encryption's c0).
    """
    result: torch.Tensor = torch.ops.fhelium.mod_down(
        values, addend, divided, moduli, tables, LEVEL_CODES[level], message, message_factors
    )
    return result


def small_ntt(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """Small signed integers ``[..., N]`` (|x| < every q) → their residues' NTT ``[..., rows, N]``
    (sampling to NTT in one call: the residue is taken inside the transform's first pass).
    """
    result: torch.Tensor = torch.ops.fhelium.small_ntt(x, moduli, tables, LEVEL_CODES[level])
    return result


def signed_ntt(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """Signed integers ``[..., N]`` with |x| < 2^62 (moduli above 2^28) → their residues' NTT
    ``[..., rows, N]``: ``small_ntt`` for values wider than the primes (the flooding noise), the residue
    exact (the same as the reference's ``reduce_signed``: a residue in [0, q) is unique).
    """
    result: torch.Tensor = torch.ops.fhelium.signed_ntt(x, moduli, tables, LEVEL_CODES[level])
    return result


def permute_last(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(-1, index)`` for int64 CPU tensors in one native pass (Galois automorphisms)."""
    result: torch.Tensor = torch.ops.fhelium.permute_last(x, index)
    return result


def tensor_product(
    a: torch.Tensor, b: torch.Tensor, moduli: torch.Tensor, level: str | None = None
) -> torch.Tensor:
    """NTT-domain ciphertexts ``[2, ..., L, N]`` → ``[3, ..., L, N]`` = (a0·b0, a0·b1 + a1·b0, a1·b1)
    mod q, limb r modulo ``moduli[r]``, in one pass.
    """
    result: torch.Tensor = torch.ops.fhelium.tensor_product(a, b, moduli, code(level))
    return result


def decompose(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """NTT ``[..., L, N]`` over ``moduli[:L]`` → ``[L, ..., L+1, N]``: digit j (the centered coefficients
    of row j) lifted to every prime of ``moduli`` (the L Q primes, then P), NTT domain.
    """
    result: torch.Tensor = torch.ops.fhelium.decompose(x, moduli, tables, LEVEL_CODES[level])
    return result


def key_switch(
    x: torch.Tensor,
    key: torch.Tensor,
    key_digits: torch.Tensor,
    key_rows: torch.Tensor,
    moduli: torch.Tensor,
    tables: torch.Tensor,
    level: str,
    *,
    lifted: bool = False,
) -> torch.Tensor:
    """Hybrid key switching in one call: NTT ``x [..., L, N]`` over ``moduli[:L]`` (``moduli`` = the L Q
    primes, then P) → ``[2, ..., L, N]`` = ModDown(Σ_j NTT(lift(digit_j))·key[key_digits[j], :, key_rows]).
    ``lifted``: ``x`` is already decomposed digits ``[L, ..., L+1, N]`` (see ``decompose``; the
    ``key_switch_lifted`` op).
    """
    op = torch.ops.fhelium.key_switch_lifted if lifted else torch.ops.fhelium.key_switch
    result: torch.Tensor = op(x, key, key_digits, key_rows, moduli, tables, LEVEL_CODES[level])
    return result


def smudging_noise(
    words: torch.Tensor,
    constants: torch.Tensor,
    shift_bits: int,
    high_sigma: float,
    low_sigma: float,
    level: str | None = None,
) -> torch.Tensor:
    """Flooding noise ``[count]`` from ``2·count`` 63-bit keystream words: the same bits as the reference
    ``fhelium.multiparty.noise.smudging_noise_from_words`` (whose module builds ``constants``).
    ``level``: ``scalar`` or ``avx2`` (the scalar loop), ``dq``/``ifma`` (the loop compiled for AVX-512);
    None: ``elementwise_level()``.
    """
    if not load():
        raise NativeUnavailableError(f"the native extension is unavailable: {load_error()}")
    result: torch.Tensor = torch.ops.fhelium.smudging_noise(
        words, constants, shift_bits, high_sigma, low_sigma, code(level)
    )
    return result
