"""Residue arithmetic and the message codec of threshold CKKS: encode, encrypt, combine, decode.

The message is encoded at the low scale 2^44 and lifted in two steps (``encode_values``,
``encrypt_values``); the summed decryption shares are combined with c0 and decoded
(``combine_decryption``, ``decode_contributions``), ``BLOCK_ROWS`` batch rows at a time. The exact
signed and summed residue reductions (``reduce_signed``, ``reduce_sum_``) serve them and the
channels. fhelium.multiparty.protocol re-exports every name.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

from fhelium.core import Ciphertext, FheliumValueError, ParameterMismatchError, Plaintext, PublicKey
from fhelium.engine import CkksEngine
from fhelium.engine import modular as mod
from fhelium.multiparty.errors import MissingSharesError
from fhelium.multiparty.parameters import THRESHOLD_AGGREGATION, ThresholdParameters
from fhelium.multiparty.values import DecryptionShare, PublicKeyShare

# Rows of a batched ciphertext processed per step of decryption_share / combine_decryption: the
# temporaries of a block (8 rows x 2 primes x 8192 residues, 1 MiB each) stay in cache and are
# reused, where whole-batch temporaries (32 MiB at 1M values) cost a page fault per 4 KiB each time.
BLOCK_ROWS = 8


def reduce_signed(x: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor) -> torch.Tensor:
    """Exact residues in [0, q) of int64 ``x`` (|x| < 2^62, q < 2^50 per row), without an integer
    division (``torch.remainder`` on int64 is several times slower).

    round(x·(1/q)) in binary64 is within 1/2 + 2^-30 of x/q, so x − round(...)·q lies in (−q, q)
    and one conditional +q gives the residue. ``q``/``q_inverse`` are ``[rows, 1]``; ``x``
    broadcasts against them (``[..., 1, N]`` noise gives ``[..., rows, N]``).
    """
    estimate = (x.double() * q_inverse).round_().long()
    residues = x - estimate.mul_(q)
    return residues.add_(torch.bitwise_and(residues >> 63, q))


def reduce_sum_(x: torch.Tensor, q: torch.Tensor, terms: int) -> torch.Tensor:
    """In place: residues in [0, q) of ``x``, a sum of ``terms`` residues (so 0 <= x < terms·q).

    Subtracts q·2^j where it does not go negative, from the largest j down (⌈log2 terms⌉ steps of
    three in-place passes, ``BLOCK_ROWS`` rows at a time); cheaper than ``torch.remainder`` or a
    full-size binary64 estimate. ``x`` is ``[..., rows, N]`` with ``q`` ``[rows, 1]``.
    """
    steps = max(0, (terms - 1).bit_length())
    flat = x.view(-1, x.size(-2), x.size(-1))
    for start in range(0, flat.size(0), BLOCK_ROWS):
        block = flat[start : start + BLOCK_ROWS]
        for j in reversed(range(steps)):
            multiple = q << j
            block.sub_(multiple)
            block.add_(torch.bitwise_and(block >> 63, multiple))
    return x


def ciphertext_digest(ct: Ciphertext) -> bytes:
    return hashlib.sha256(ct.data[1].contiguous().cpu().numpy().tobytes()).digest()


def encode_integers(
    engine: CkksEngine, values: torch.Tensor, parameters: ThresholdParameters
) -> torch.Tensor:
    """Real slots ``[rows, ≤S]`` → the coefficients at the low scale 2^44, rounded: int64 ``[rows, N]``.

    The engine's encoder rounds to integers below 2^62, so the message is encoded at 2^44; times
    2^(88-44) (applied modulo each prime) it is the message at the scale 2^88 (the rounding error,
    2^-44 of a slot unit, is far below the flooding noise).
    """
    message = torch.as_tensor(values).double().cpu()
    if message.ndim == 1:
        message = message.unsqueeze(0)
    if message.size(-1) > engine.slot_count:
        raise FheliumValueError(f"encode got {message.size(-1)} slots; this engine has {engine.slot_count}")
    if message.size(-1) < engine.slot_count:
        message = torch.nn.functional.pad(message, (0, engine.slot_count - message.size(-1)))
    low = float(2**parameters.encode_scale_bits)
    coefficients = engine.encoder.slots_to_coefficients(message).mul_(low)
    largest = max(abs(float(bound)) for bound in torch.aminmax(coefficients)) if coefficients.numel() else 0.0
    if not math.isfinite(largest) or largest >= 2.0**62:
        raise FheliumValueError(
            f"encoded coefficients reach {largest:.3g}: the values are too large to encode"
        )
    return coefficients.round_().long().to(engine.device)


def encode_values(engine: CkksEngine, values: torch.Tensor, parameters: ThresholdParameters) -> Plaintext:
    """Real slots ``[rows, ≤S]`` → a coefficient-domain rns Plaintext at the message scale 2^88
    (``encode_integers``, then the residues multiplied by 2^44 mod each prime).
    """
    ids = engine.q_ids_at(0)
    q = engine._mod(ids)
    shift = parameters.message_scale_bits - parameters.encode_scale_bits
    factor = torch.tensor(
        [[pow(2, shift, p)] for p in engine.moduli_for(ids)], dtype=torch.int64, device=engine.device
    )
    integers = encode_integers(engine, values, parameters)
    batch = integers.shape[:-1]
    integers = integers.view(-1, 1, engine.ring_degree)
    residues = torch.empty(
        integers.size(0), len(ids), engine.ring_degree, dtype=torch.int64, device=engine.device
    )
    for start in range(0, integers.size(0), BLOCK_ROWS):  # cache-sized blocks (see BLOCK_ROWS)
        stop = start + BLOCK_ROWS
        block = reduce_signed(integers[start:stop], q.q, q.q_inverse)
        residues[start:stop] = mod.mul_mod(block, factor, q.q, q.q_inverse)
    residues = residues.view(*batch, len(ids), engine.ring_degree)
    return Plaintext(None, 0, parameters.message_scale, residues, "rns", "coefficient", "Q", "standard", ids)


def encrypt_values(
    engine: CkksEngine,
    values: torch.Tensor,
    public: PublicKey,
    parameters: ThresholdParameters = THRESHOLD_AGGREGATION,
    *,
    c0_noise: Callable[[int], torch.Tensor] | None = None,
) -> Ciphertext:
    """Public-key encryption of real slots ``[rows, ≤S]`` under the collective key: the same
    ciphertext as ``engine.encrypt(encode_values(...))``, without the residue tensor of the
    message (``CkksEngine.encrypt_integers`` takes the residues inside ModDown). ``c0_noise``:
    ``encrypt_integers``'s (``ThresholdParty.encrypt_flooded`` puts the flooding noise there).
    """
    shift = parameters.message_scale_bits - parameters.encode_scale_bits
    integers = encode_integers(engine, values, parameters)
    return engine.encrypt_integers(
        integers, public, scale=parameters.message_scale, multiplier=1 << shift, c0_noise=c0_noise
    )


# what needs a share from every rank, what follows the missing ranks, and what a share that does not
# fit was made for, per kind of share summed by sum_every_party
_SHARE_SUMS: dict[str, tuple[str, str, str]] = {
    "decryption": (
        "N-out-of-N decryption needs a decryption share",
        ": without every share the sum is noise",
        "decryption share was made for another ciphertext",
    ),
    "public key": (
        "the collective public key needs a key share",
        "",
        "key share was made for another seed or other parameters",
    ),
}


def sum_every_party(
    kind: str,
    shares: Sequence[DecryptionShare] | Sequence[PublicKeyShare],
    parties: int | None,
    q: torch.Tensor,
    shape: Sequence[int],
    **expected: object,
) -> torch.Tensor:
    """Σ ``share.data`` mod ``q`` of one share from each of the ``parties`` ranks (default: the first
    share's ``parties``), each of ``shape`` and with the ``expected`` field values: else
    MissingSharesError naming the missing ranks or ParameterMismatchError naming the rank whose share
    does not fit, worded for ``kind`` (a key of ``_SHARE_SUMS``). ``shares`` must not be empty.
    """
    needs, missing_tail, refusal = _SHARE_SUMS[kind]
    count = shares[0].parties if parties is None else parties
    ranks = sorted(share.party for share in shares)
    if ranks != list(range(count)):
        missing = sorted(set(range(count)) - set(ranks))
        raise MissingSharesError(
            f"{needs} from each of {count} ranks; missing rank(s) {missing}{missing_tail}", missing
        )
    for share in shares:
        if share.data.shape != tuple(shape) or any(
            getattr(share, name) != value for name, value in expected.items()
        ):
            raise ParameterMismatchError(f"rank {share.party}'s {refusal}")
    total = shares[0].data.clone()
    for share in shares[1:]:
        mod.add_mod_(total, share.data, q)
    return total


def combine_decryption(
    engine: CkksEngine,
    ct: Ciphertext,
    shares: Sequence[DecryptionShare] | torch.Tensor,
    *,
    parties: int | None = None,
) -> torch.Tensor:
    """Slots (complex128 ``[*batch, S]``) of c0 + Σ h_i. ``shares`` may be the summed residues."""
    ids = ct.prime_ids
    q = engine._mod(ids).q
    if isinstance(shares, torch.Tensor):
        total = shares.to(engine.device)
    else:
        if not shares:
            raise MissingSharesError("decryption needs every party's share; got none", [])
        digest = ciphertext_digest(ct)
        total = sum_every_party(
            "decryption", shares, parties, q, ct.data.shape[1:], ciphertext_digest=digest, prime_ids=ids
        )
    if total.shape != ct.data.shape[1:]:
        raise ParameterMismatchError(
            f"summed decryption shares have shape {tuple(total.shape)}; expected {tuple(ct.data.shape[1:])}"
        )
    # c0 + Σ h_i, back to coefficients and CRT-reconstructed, BLOCK_ROWS batch rows at a time
    n = engine.ring_degree
    c0 = ct.data[0].reshape(-1, len(ids), n)
    summed = total.reshape(-1, len(ids), n)
    coefficients = torch.empty(c0.size(0), n, dtype=torch.float64)
    for start in range(0, c0.size(0), BLOCK_ROWS):
        stop = start + BLOCK_ROWS
        phase = mod.add_mod(c0[start:stop], summed[start:stop], q)
        if ct.polynomial_domain == "ntt":
            phase = engine.ntt.inverse(phase, ids)
        coefficients[start:stop] = engine._reconstruct(phase, ids).cpu()
    coefficients = coefficients.view(*ct.batch_shape, n)
    plaintext = Plaintext(None, ct.depth, ct.scale, coefficients, "approximate_coefficients")
    return engine.decode(plaintext)


def decode_contributions(
    engine: CkksEngine, summed: torch.Tensor, prime_ids: Sequence[int], scale: float, *, depth: int = 0
) -> torch.Tensor:
    """Real slots (float64 ``[rows, S]``) of Σ_i (c0_i + h_i) = c0 + Σ h_i, NTT domain ``[rows, limbs, N]``.

    Inverse NTT, CRT reconstruction and decoding, ``BLOCK_ROWS`` rows at a time.
    """
    ids = tuple(prime_ids)
    n = engine.ring_degree
    rows = summed.reshape(-1, len(ids), n)
    coefficients = torch.empty(rows.size(0), n, dtype=torch.float64)
    for start in range(0, rows.size(0), BLOCK_ROWS):
        phase = engine.ntt.inverse(rows[start : start + BLOCK_ROWS], ids)
        coefficients[start : start + phase.size(0)] = engine._reconstruct(phase, ids).cpu()
    plaintext = Plaintext(None, depth, scale, coefficients, "approximate_coefficients")
    return engine.decode(plaintext).real


__all__ = [
    "BLOCK_ROWS",
    "ciphertext_digest",
    "combine_decryption",
    "decode_contributions",
    "encode_integers",
    "encode_values",
    "encrypt_values",
    "reduce_signed",
    "reduce_sum_",
    "sum_every_party",
]
