"""The sum checks' secret challenge: agreed once per key generation, derived per round, sans-io.

The fused aggregation (``ThresholdSession.aggregate``) checks every sum the channel's fold returns
with a random projection (fhelium.multiparty.sumcheck). The multipliers must be unknown to the fold
when it fixes a sum; this module makes them a secret of the ranks, known *before* the sums, so each
rank projects its own input before the in-place sum overwrites it and the projections ride the fold
itself, as one small residue sum beside the sum they check (no copies, no commit-reveal exchanges).

**Agreement** (at ``generate_public_key``, three record exchanges): every rank publishes an X25519
public key (its dealing key, fresh per session or an operator-kept one, checked against the pins as
for t-out-of-N dealing); every rank draws a 32-byte seed and seals it to every other rank under
ChaCha20-Poly1305 with a key from X25519 and HKDF-SHA256 (direction i → j), the associated data
binding the session, the common seed of this key generation, the world size, dealer, receiver and
both public keys (``seal_seed``, ``open_seed``); the challenge key is SHA-256 over every seed in rank
order (``challenge_key``). Every rank then all-gathers a confirmation (``confirmation``: a digest of
the key list and one digest per dealer's seed): a rank that dealt different seeds to different ranks,
or a transport that showed ranks different keys, is named on every rank (``check_confirmations``)
instead of giving ranks different challenges, whose checks would refuse every honest round with a
misleading verdict. The transport carries only public keys, sealed seeds and digests: whoever runs
it (the controller on the relay road) learns nothing of the key, unless it substitutes public keys
(an active attack on the agreement the confirmation catches when some ranks were shown another
list, and pins refuse outright).

**Per round** (``round_challenge``): from the key, the session, the round, the exchange and the world
size, with SHA-256 and the engine's ChaCha20 ``RandomSource``: one uniform multiplier per row and
limb for each slice (``weights``), which project a slice ``[rows, limbs, N]`` to ``[limbs, N]``, and
one per limb and coefficient (``coefficients``), which ``compress`` that to one value per limb; this
rank's one-time mask ``M_r = U_r − U_{r+1 mod w}`` (plus ``W`` on rank 0), so the masks add up to
``W`` and all of them together are uniform (``mask``, ``total_mask``); and ``flag``, a non-zero
per-limb value a rank adds to its masked projection when it refused the c1 sum (``sum_verdict``
counts the flags). Each round and exchange derives fresh values: learning one round's multipliers
or masks tells nothing about another's.

docs/security.md, "Threshold aggregation", holds the model and the soundness argument.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fhelium.engine import modular as mod
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty.dealing import (
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    TAG_BYTES,
    DealingIdentity,
    Recipient,
    open_from,
    seal_to_each,
)
from fhelium.multiparty.errors import MultipartyError

AGREEMENT_DOMAIN = b"fhelium.multiparty.sum-check-key.v1"
CONFIRMATION_DOMAIN = b"fhelium.multiparty.sum-check-key-confirmation.v1"
ROUND_DOMAIN = b"fhelium.multiparty.sum-check-round.v1"
SEED_BYTES = 32
DIGEST_BYTES = 32
SEALED_SEED_BYTES = NONCE_BYTES + SEED_BYTES + TAG_BYTES

NOT_THE_SUM = -1
"""``sum_verdict`` of a sum that is not the sum of the ranks' inputs (0: it is; j > 0: it is, but j
ranks flagged that they refused the c1 sum and published random residues instead of a contribution)."""


class ChallengeKeyError(MultipartyError):
    """The ranks do not hold the same challenge key: a sealed seed was refused, or ranks disagree.

    ``ranks`` names the dealers (or key holders) at fault as far as this rank can tell.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)


def _header(session: str, world: int) -> bytes:
    text = f"{len(session)}:{session}/{world}".encode()
    return len(text).to_bytes(4, "big") + text


def seed_aad(
    session: str, common_seed: bytes, world: int, dealer: int, receiver: int, dealer_key: bytes,
    receiver_key: bytes,
) -> bytes:
    """What a sealed seed is bound to: the session, this key generation, the world, the direction and
    both keys.
    """
    return (
        AGREEMENT_DOMAIN + _header(session, world) + f"/{dealer}->{receiver}".encode() + common_seed
        + dealer_key + receiver_key
    )


def fresh_seed() -> bytes:
    return secrets.token_bytes(SEED_BYTES)


def seal_seed(
    identity: DealingIdentity,
    seeds: Mapping[int, bytes],
    keys: Sequence[bytes],
    *,
    dealer: int,
    session: str,
    common_seed: bytes,
) -> bytes:
    """Dealer ``dealer``'s record: for every other rank in rank order, nonce ‖ its seed sealed to that rank.

    ``seeds`` maps each receiver to the seed sealed for it: an honest dealer gives every receiver the
    same one (a dealer that does not is named by ``check_confirmations``).
    """
    world = len(keys)
    return seal_to_each(
        identity,
        keys,
        dealer,
        seeds.__getitem__,
        lambda receiver: seed_aad(
            session, common_seed, world, dealer, receiver, keys[dealer], keys[receiver]
        ),
        AGREEMENT_DOMAIN,
        ChallengeKeyError,
    )


def open_seed(
    recipient: Recipient,
    record: bytes,
    *,
    dealer: int,
    session: str,
    common_seed: bytes,
) -> bytes:
    """The seed ``dealer`` sealed for ``recipient`` (this rank), authenticated; else ChallengeKeyError
    naming the dealer.
    """
    keys, receiver = recipient.keys, recipient.rank
    aad = seed_aad(session, common_seed, len(keys), dealer, receiver, keys[dealer], keys[receiver])
    return open_from(
        recipient, record, dealer=dealer, entry_bytes=SEALED_SEED_BYTES, aad=aad, domain=AGREEMENT_DOMAIN,
        refuse=ChallengeKeyError, what="sealed challenge seeds",
        forged=f"the challenge seed rank {dealer} sealed for rank {receiver} fails authentication: it was "
        "altered, re-addressed, or sealed for another session, key generation or public key; the "
        "collective key is refused",
    )


def challenge_key(session: str, common_seed: bytes, keys: Sequence[bytes], seeds: Sequence[bytes]) -> bytes:
    """SHA-256 over the session, this key generation, every public key and every seed in rank order."""
    digest = hashlib.sha256(AGREEMENT_DOMAIN + b"/challenge-key" + _header(session, len(keys)) + common_seed)
    for key in keys:
        digest.update(key)
    for seed in seeds:
        digest.update(seed)
    return digest.digest()


def confirmation(session: str, common_seed: bytes, keys: Sequence[bytes], seeds: Sequence[bytes]) -> bytes:
    """What a rank publishes to confirm the agreement: a digest of the key list, then one per dealer's seed.

    The digests hide the seeds (32 random bytes each; the key is another hash of all of them) and
    let every rank tell which dealer's seed, or which key list, another rank holds differently.
    """
    header = CONFIRMATION_DOMAIN + _header(session, len(keys)) + common_seed
    out = bytearray(hashlib.sha256(header + b"/keys" + b"".join(keys)).digest())
    for dealer, seed in enumerate(seeds):
        out += hashlib.sha256(header + f"/seed/{dealer}".encode() + seed).digest()
    return bytes(out)


def check_confirmations(rank: int, confirmations: Sequence[bytes]) -> None:
    """Refuse, naming the ranks, unless every rank published this rank's confirmation."""
    mine = confirmations[rank]
    world = len(confirmations)
    malformed = [other for other, theirs in enumerate(confirmations) if len(theirs) != len(mine)]
    if malformed:
        raise ChallengeKeyError(
            f"rank(s) {malformed} published a challenge key confirmation of another length than rank "
            f"{rank}'s ({len(mine)} bytes): the collective key is refused",
            malformed,
        )
    keys_differ = [
        other for other, theirs in enumerate(confirmations) if theirs[:DIGEST_BYTES] != mine[:DIGEST_BYTES]
    ]
    if keys_differ:
        raise ChallengeKeyError(
            f"rank(s) {keys_differ} saw other public keys than rank {rank} in the challenge key agreement: "
            "the transport showed ranks different keys (a substituted key would let it read the seeds "
            "sealed to it); the collective key is refused. Pin the ranks' keys (docs/security.md, "
            "'Threshold aggregation')",
            keys_differ,
        )
    equivocating = [
        dealer
        for dealer in range(world)
        if any(
            theirs[DIGEST_BYTES * (1 + dealer) : DIGEST_BYTES * (2 + dealer)]
            != mine[DIGEST_BYTES * (1 + dealer) : DIGEST_BYTES * (2 + dealer)]
            for theirs in confirmations
        )
    ]
    if equivocating:
        raise ChallengeKeyError(
            f"rank(s) {equivocating} sealed different challenge seeds to different ranks (the ranks "
            "disagree on them): the ranks would hold different challenge keys and every sum check would "
            "fail; the collective key is refused. Restart the run without those ranks",
            equivocating,
        )


@dataclass(frozen=True)
class RoundChallenge:
    """One check of one round on one rank: multipliers per slice and per coefficient, this rank's mask,
    the masks' sum, the flag.

    ``weights[part]`` ``[rows, limbs, 1]``; ``coefficients`` ``[limbs, N]``; ``mask``, ``total_mask``
    and ``flag`` ``[parts, limbs, 1]``, every flag in [1, q).
    """

    weights: list[torch.Tensor]
    coefficients: torch.Tensor
    mask: torch.Tensor
    total_mask: torch.Tensor
    flag: torch.Tensor


def _source(sub_key: bytes, label: str) -> RandomSource:
    return RandomSource(hashlib.sha256(sub_key + label.encode()).digest(), purpose="general")


def round_challenge(
    key: bytes,
    *,
    session: str,
    round_number: int,
    what: str,
    rank: int,
    world: int,
    moduli: torch.Tensor,
    part_rows: Sequence[int],
    ring_degree: int,
) -> RoundChallenge:
    """This rank's challenge for the check of ``what`` in round ``round_number`` (the module docstring)."""
    header = _header(session, world) + f"/{round_number}/{what}".encode()
    sub_key = hashlib.sha256(ROUND_DOMAIN + header + key).digest()
    q = moduli.reshape(-1, 1).cpu()
    limbs, parts = q.size(0), len(part_rows)
    weights = []
    for part, rows in enumerate(part_rows):
        drawn = _source(sub_key, f"weights/{part}").uniform_below(q, (limbs, rows))
        weights.append(drawn.t().contiguous().unsqueeze(-1).to(moduli.device))
    coefficients = _source(sub_key, "coefficients").uniform_below(q, (limbs, ring_degree))
    shape = (parts, limbs, 1)

    def pad(label: str) -> torch.Tensor:
        return _source(sub_key, label).uniform_below(q, shape)

    total = pad("total")
    mask = pad(f"mask/{rank}")
    mask = torch.remainder(mask - pad(f"mask/{(rank + 1) % world}"), q)
    if rank == 0:
        mask = torch.remainder(mask + total, q)
    flag = _source(sub_key, "flag").uniform_below(q - 1, (parts, limbs, 1)) + 1
    device = moduli.device
    return RoundChallenge(
        weights, coefficients.to(device), mask.to(device), total.to(device), flag.to(device)
    )


COMPRESS_CHUNK = 4096
"""Coefficients summed at once by ``compress``: 4096 values below 2^50 stay below 2^62 in int64."""


def compress(projection: torch.Tensor, coefficients: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_n coefficients[n]·projection[n] mod q per limb: ``[limbs, 1]`` from ``[limbs, N]``, exact.

    The second stage of the check's projection: Σ_n σ_n·Σ_r ρ_r·δ[r, n] is a non-zero polynomial of
    degree 2 in the uniform multipliers whenever δ ≠ 0, so it vanishes (or hits any fixed value) with
    probability at most 2/q (Schwartz–Zippel).
    """
    moduli = q.reshape(-1, 1)
    products = mod.mul_mod(projection, coefficients, moduli, 1.0 / moduli.double())
    total = torch.zeros((products.size(0), 1), dtype=torch.int64, device=products.device)
    for start in range(0, products.size(-1), COMPRESS_CHUNK):
        total += products[:, start : start + COMPRESS_CHUNK].sum(-1, keepdim=True)
        total = torch.remainder(total, moduli)
    return total


def masked(
    projections: Sequence[torch.Tensor], drawn: RoundChallenge, q: torch.Tensor, *, flagged: bool
) -> torch.Tensor:
    """``[parts, limbs, 1]``: each slice's compressed projection (``compress``) plus this rank's mask
    (plus the flag if ``flagged``).
    """
    stacked = torch.stack(list(projections)) + drawn.mask
    if flagged:
        stacked += drawn.flag
    return torch.remainder(stacked, q.reshape(-1, 1)).contiguous()


def sum_verdict(
    projection: torch.Tensor, summed: torch.Tensor, total_mask: torch.Tensor, flag: torch.Tensor,
    q: torch.Tensor, world: int,
) -> int:
    """Whether ``projection`` (the compressed projection of the sum a rank holds, ``[limbs, 1]``) matches
    ``summed`` (the fold's sum of the masked projections): 0, ``NOT_THE_SUM``, or j > 0 when it matches
    up to j flags.
    """
    moduli = q.reshape(-1, 1)
    difference = torch.remainder(summed - total_mask - projection, moduli)
    if not bool(difference.any()):
        return 0
    for flags in range(1, world + 1):
        if torch.equal(difference, torch.remainder(flags * flag, moduli).expand_as(difference)):
            return flags
    return NOT_THE_SUM


__all__ = [
    "AGREEMENT_DOMAIN",
    "CONFIRMATION_DOMAIN",
    "NOT_THE_SUM",
    "PUBLIC_KEY_BYTES",
    "ROUND_DOMAIN",
    "SEALED_SEED_BYTES",
    "SEED_BYTES",
    "ChallengeKeyError",
    "RoundChallenge",
    "challenge_key",
    "check_confirmations",
    "compress",
    "confirmation",
    "fresh_seed",
    "masked",
    "open_seed",
    "round_challenge",
    "seal_seed",
    "seed_aad",
    "sum_verdict",
]
