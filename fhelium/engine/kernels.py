"""RNS kernels the engine's capabilities share: small-integer NTT, ModDown, rescale constants, CRT.

Plain functions of a ``CkksEngine`` (its tables and caches); ``CkksEngine`` exposes them under their
former private names (``_small_ntt``, ``_mod_down``, ``_inverse_constants``, ``_reconstruct``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The module itself: `from fhelium.engine import modular` would go through the package.
import fhelium.engine.modular as mod
from fhelium import native as _native
from fhelium.engine.operations import EngineOperations


def small_ntt(engine: EngineOperations, values: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
    """Small signed integers ``[..., N]`` → NTT residues ``[..., rows, N]`` (one native call on CPU)."""
    if engine.ntt.native_level != "torch":
        return _native.small_ntt(values, *engine.ntt._native_tables(prime_ids), engine.ntt.native_level)
    return engine.ntt.forward(engine._small_to_rns(values, prime_ids), prime_ids)


def reconstruct(engine: EngineOperations, residues: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
    """Centered float64 value from the trailing one or two coefficient-domain rows."""
    if len(prime_ids) == 1:
        q = engine._mod(prime_ids).q
        return mod.center(residues[..., 0, :], q[0]).double()
    q1, q2 = engine.moduli_for(prime_ids[-2:])
    x1 = residues[..., -2, :]
    x2 = residues[..., -1, :]
    q1_t = torch.tensor(q1, dtype=torch.int64, device=residues.device)
    q2_t = torch.tensor(q2, dtype=torch.int64, device=residues.device)
    inverse = torch.full_like(x1, pow(q1, -1, q2))
    difference = mod.sub_mod(x2, torch.remainder(x1, q2_t), q2_t)
    k = mod.center(mod.mul_mod(difference, inverse, q2_t, 1.0 / q2_t.double()), q2_t)
    return x1.double() + float(q1_t) * k.double()


def mod_down(
    engine: EngineOperations,
    values: torch.Tensor,
    ids: tuple[int, ...],
    addend: torch.Tensor | None = None,
    divided: torch.Tensor | None = None,
) -> torch.Tensor:
    """NTT values over ``ids + (P,)`` → round((values + ``divided``) / P) (+ ``addend``) over
    ``ids``, NTT domain; neither extra term costs a transform.

    ``addend`` is a coefficient-domain residue tensor over ``ids``; it is folded into the one
    forward NTT ModDown needs anyway (as −P·addend, which the division by P turns into
    +addend). ``divided`` holds small signed coefficient-domain integers ``[..., 1, N]``: with
    v = values + divided, ModDown needs v's P row in the coefficient domain (INTT of values'
    P row, plus divided) and v_Q − NTT(lift) = values_Q − NTT(lift − divided).
    """
    special = engine.special_prime_id
    if engine.ntt.native_level != "torch":
        tables = engine.ntt._native_tables((*ids, special))
        if addend is None and divided is None:
            return _native.divide_round(values, *tables, len(ids), ntt=True, level=engine.ntt.native_level)
        if addend is not None:
            addend = addend.expand(*values.shape[:-2], len(ids), engine.ring_degree)
        if divided is not None:
            divided = divided.expand(*values.shape[:-2], 1, engine.ring_degree)
        return _native.mod_down(values, addend, divided, *tables, engine.ntt.native_level)
    q_mod = engine._mod(ids)
    p_q = engine._mod((special,)).q
    p_row = engine.ntt.inverse(values[..., -1:, :], (special,))
    if divided is not None:
        p_row = mod.correct(p_row + divided, p_q)  # |divided| << P: one correction each way
    lifted = torch.remainder(mod.center(p_row, p_q), q_mod.q)
    if divided is not None:
        lifted = mod.sub_mod(lifted, torch.remainder(divided, q_mod.q), q_mod.q)
    if addend is not None:
        p_residues = torch.remainder(
            torch.tensor(engine.moduli[special], device=engine.device), q_mod.q
        ).expand_as(addend)
        scaled = mod.mul_mod(addend, p_residues, q_mod.q, q_mod.q_inverse)
        lifted = mod.sub_mod(lifted, scaled, q_mod.q)
    correction = engine.ntt.forward(lifted, ids)
    difference = mod.sub_mod(values[..., :-1, :], correction, q_mod.q)
    p_inverse, p_inverse_over_q = engine._inverse_constants(engine.moduli[special], ids)
    return mod.mul_mod_shoup(difference, p_inverse, p_inverse_over_q, q_mod.q)


def inverse_constants(
    engine: EngineOperations, value: int, ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (value, ids)
    cached = engine._inverse_cache.get(key)
    if cached is None:
        q = engine._mod(ids).q
        inverse = torch.tensor(
            [pow(value, -1, prime) for prime in engine.moduli_for(ids)],
            dtype=torch.int64,
            device=engine.device,
        ).unsqueeze(-1)
        cached = (inverse, inverse.double() / q.double())
        engine._inverse_cache[key] = cached
    return cached
