"""Verified sums: the checks that a sum the channel's fold returned is the sum of this round's inputs.

The channel's fold is not trusted (docs/security.md, "Threshold aggregation"). Once every rank holds
the sum it was handed, the ranks draw a random challenge the fold could not know when it fixed the
sums: every rank commits (SHA-256, bound to the session, the round, the exchange and the rank) to a
fresh 32-byte seed, then reveals it; a reveal that does not match its commitment is refused, naming
the rank and the round. The challenge (every seed hashed in rank order) gives one uniform multiplier
per row and limb: every rank all-gathers the projection of its own input and a fingerprint of the
projection of the sum it holds (different sums for different ranks are named), and the projections
of the inputs must add up to the projection of the sum, exactly, modulo each prime. No pass hashes
a whole sum. ``ThresholdSession`` (fhelium.multiparty.distributed) runs them; the t-out-of-N round
(``fhelium.multiparty.dropout``) draws its own members-only challenge the same way
(``draw_member_challenge``) and expands it with ``projection_weights``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from fhelium.engine import CkksEngine
from fhelium.engine import modular as mod
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty.channel import ShareChannel
from fhelium.multiparty.protocol import MultipartyError

SUM_CHECK_DOMAIN = b"fhelium.multiparty.sum-check.v1"
CHALLENGE_COMMIT_DOMAIN = b"fhelium.multiparty.sum-check-commit.v1"
CHALLENGE_DOMAIN = b"fhelium.multiparty.sum-check-challenge.v1"
DIGEST_BYTES = 32
SEED_BYTES = 32


class SumCheckError(MultipartyError):
    """A sum the channel (the fold) returned is not the sum of this round's inputs: refused.

    ``round`` is the session's aggregation round; ``ranks`` the ranks that were handed another sum
    than this one (empty when every rank got the same wrong sum).
    """

    def __init__(self, message: str, round_number: int, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.round = round_number
        self.ranks = sorted(ranks)


def out_of_range(residues: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether any residue of ``[..., limbs, N]`` lies outside [0, q_limb).

    One min/max pass over the whole tensor against the smallest prime settles almost every sum;
    only when a residue lies between the smallest and its own limb's prime are the limbs checked
    one by one.
    """
    moduli = q.reshape(-1)
    low, high = (int(bound) for bound in torch.aminmax(residues))
    if low < 0:
        return True
    if high < int(moduli.min()):
        return False
    _, highs = torch.aminmax(residues.reshape(-1, residues.size(-2), residues.size(-1)), dim=-1)
    return bool((highs >= moduli.to(highs.device)).any())


def projection_weights(digest: bytes, moduli: torch.Tensor, rows: int) -> torch.Tensor:
    """The Fiat–Shamir challenge of ``digest``: one uniform multiplier per row and limb, ``[rows, limbs, 1]``.

    Expanded with the engine's ChaCha20 ``RandomSource`` from the digest of the sum being checked, so
    the fold cannot know the multipliers before it has committed to the sum (every rank derives the
    same ones from the same sum).
    """
    q = moduli.reshape(-1, 1).cpu()
    weights = RandomSource(digest, purpose="general").uniform_below(q, (q.size(0), rows))
    return weights.t().contiguous().unsqueeze(-1).to(moduli.device)


def project(
    residues: torch.Tensor, weights: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor
) -> torch.Tensor:
    """Σ_r weights[r]·residues[r] mod q: ``[limbs, N]`` from ``[rows, limbs, N]`` residues, exact.

    One pass over the rows: natively (``native.project_rows``) one 64-bit product per residue, summed in
    128 bits and reduced once; else the torch reference below, one modular product per residue
    (mul_mod and add_mod), which the native result matches bit for bit.
    """
    rows = residues.reshape(-1, residues.size(-2), residues.size(-1))
    operands = _native_operands(rows, weights, q)
    if operands is not None:
        from fhelium import native

        return native.project_rows(*operands)
    total = torch.zeros(rows.shape[1:], dtype=torch.int64, device=rows.device)
    for row, weight in zip(rows, weights, strict=True):
        mod.add_mod_(total, mod.mul_mod(row, weight, q, q_inverse), q)
    return total


def project_checked(
    residues: torch.Tensor, weights: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """``project`` of ``residues`` and their ``out_of_range``, from one pass where the native kernel runs.

    A sum is read once for both (``native.project_rows_checked``: one more compare per residue); the
    torch path takes the two passes, with the same results.
    """
    operands = _native_operands(residues.reshape(-1, residues.size(-2), residues.size(-1)), weights, q)
    if operands is not None:
        from fhelium import native

        projection, in_range = native.project_rows_checked(*operands)
        return projection, not in_range
    return project(residues, weights, q, q_inverse), residues.numel() > 0 and out_of_range(residues, q)


def _native_operands(
    rows: torch.Tensor, weights: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows ``[R, L, N]``, weights ``[R, L]``, q ``[L]``) for the native projection kernels, or None where
    they do not serve (no extension, the torch level, another device).
    """
    if not mod._native_elementwise(rows, weights, q):
        return None
    return rows, weights.reshape(rows.size(0), rows.size(1)), q.reshape(-1)


SUM_LABELS = {
    "ciphertext-c1": "c1 sum",
    "decryption-contributions": "sum of the decryption contributions",
}


def refuse(
    session: str, rank: int, what: str, round_number: int, detail: str, ranks: Sequence[int] = ()
) -> SumCheckError:
    """The ``SumCheckError`` of rank ``rank`` refusing the ``what`` sum of round ``round_number``."""
    label = SUM_LABELS.get(what, what)
    action = (
        "refuses to publish its decryption contribution"
        if what == "ciphertext-c1"
        else "refuses to decode it"
    )
    return SumCheckError(
        f"aggregation round {round_number} of session {session!r}: the {label} the channel "
        f"(the aggregator's fold) returned {detail}; rank {rank} {action}. The aggregator "
        "substituted, dropped, replayed, scaled or reordered inputs, or answered ranks differently "
        "(docs/security.md, 'Threshold aggregation'); run the round again over an aggregator you "
        "trust to be correct",
        round_number,
        ranks,
    )


def seed_commitment(
    session: str, round_number: int, what: str, rank: int, world: int, seed: bytes
) -> bytes:
    """SHA-256 commitment of rank ``rank`` to its challenge ``seed`` for one check of one round.

    Bound to the session, the round, the exchange and the rank: an earlier round's commitment (or
    its reveal) replayed into this round, or one rank's moved to another, no longer matches.
    """
    header = f"{len(session)}:{session}/{round_number}/{what}/{rank}/{world}".encode()
    return hashlib.sha256(CHALLENGE_COMMIT_DOMAIN + len(header).to_bytes(4, "big") + header + seed).digest()


def draw_challenge(channel: ShareChannel, session: str, what: str, round_number: int) -> bytes:
    """The check's random challenge, drawn jointly once every rank holds the sum it was handed.

    Two record exchanges: every rank all-gathers the commitment to a fresh 32-byte seed
    (``seed_commitment``), then the seed itself; a reveal that does not match its rank's commitment
    is refused, naming the rank and the round. Returns SHA-256 of every seed in rank order (bound
    to the session, the round and the exchange): uniform as long as one rank's seed is, and unknown
    to the fold until every rank has revealed, which an honest rank does only after it holds its sum.
    """
    rank, world = channel.rank, channel.world_size
    seed = secrets.token_bytes(SEED_BYTES)
    mine = seed_commitment(session, round_number, what, rank, world, seed)
    commitments = channel.all_gather_bytes(f"{what}-commit:{round_number}", mine, max_bytes=DIGEST_BYTES)
    seeds = channel.all_gather_bytes(f"{what}-reveal:{round_number}", seed, max_bytes=SEED_BYTES)
    forged = [
        other
        for other, (commitment, revealed) in enumerate(zip(commitments, seeds, strict=True))
        if len(revealed) != SEED_BYTES
        or len(commitment) != DIGEST_BYTES
        or seed_commitment(session, round_number, what, other, world, revealed) != commitment
    ]
    if forged:
        label = SUM_LABELS.get(what, what)
        raise SumCheckError(
            f"aggregation round {round_number} of session {session!r}: rank(s) {forged} revealed a "
            f"challenge seed for the check of the {label} that does not match the commitment it "
            f"published for round {round_number}; rank {rank} refuses to go on with the round. A "
            "rank (or whoever rewrote its records) changed its seed after seeing the others', or "
            "replayed an earlier round's commitment or seed (docs/security.md, 'Threshold "
            "aggregation'); run the round again without that rank",
            round_number,
            forged,
        )
    header = f"{len(session)}:{session}/{round_number}/{what}/{world}".encode()
    joined = b"".join(seeds)
    return hashlib.sha256(CHALLENGE_DOMAIN + len(header).to_bytes(4, "big") + header + joined).digest()


def challenge_weights(challenge: bytes, part: int, moduli: torch.Tensor, rows: int) -> torch.Tensor:
    """The multipliers ``[rows, limbs, 1]`` of slice ``part`` under a drawn ``challenge``."""
    return projection_weights(hashlib.sha256(challenge + part.to_bytes(4, "big")).digest(), moduli, rows)


def check_sums(
    channel: ShareChannel,
    engine: CkksEngine,
    session: str,
    what: str,
    round_number: int,
    own: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    prime_ids: Sequence[int],
) -> None:
    """Refuse unless every rank holds the same ``sums`` and each is the sum of the ranks' ``own``.

    The ranks draw a challenge (``draw_challenge``: commit, reveal), every sum is projected and
    range-checked in one pass (``project_checked``), and one record exchange carries, per part, a
    fingerprint (SHA-256) of the projection of the sum this rank holds and the projection of this
    rank's own residues. Every rank checks every fingerprint against its own (different sums for
    different ranks are named) and the sum of the projections against the projection of the sum. A
    sum out of range is refused before this rank's check record (the first thing it publishes that
    depends on the sum) is sent.
    """
    ids = tuple(prime_ids)
    m = engine._mod(ids)
    for part, (mine, summed) in enumerate(zip(own, sums, strict=True)):
        if tuple(summed.shape) != tuple(mine.shape):
            raise refuse(
                session,
                channel.rank,
                what,
                round_number,
                f"has shape {tuple(summed.shape)} where slice {part} has {tuple(mine.shape)}",
            )
    challenge = draw_challenge(channel, session, what, round_number)
    weights = [
        challenge_weights(challenge, part, m.q, s.reshape(-1, len(ids), s.size(-1)).size(0))
        for part, s in enumerate(sums)
    ]
    projections = [project(o, w, m.q, m.q_inverse) for o, w in zip(own, weights, strict=True)]
    expected = []
    for part, (summed, w) in enumerate(zip(sums, weights, strict=True)):
        projection, bad = project_checked(summed, w, m.q, m.q_inverse)
        if bad:  # residues at or above their prime would be congruent to a checked value yet feed the
            # modular kernels out of their range
            raise refuse(
                session, channel.rank, what, round_number, f"has residues outside [0, q) in slice {part}"
            )
        expected.append(projection)
    fingerprints = [hashlib.sha256(p.contiguous().cpu().numpy().data).digest() for p in expected]
    record = b"".join(
        f + p.contiguous().cpu().numpy().tobytes() for f, p in zip(fingerprints, projections, strict=True)
    )
    records = channel.all_gather_bytes(f"{what}-check:{round_number}", record, max_bytes=len(record))
    differing = [
        rank
        for rank, blob in enumerate(records)
        if len(blob) != len(record)
        or any(
            blob[offset : offset + DIGEST_BYTES] != fingerprint
            for offset, fingerprint in zip(_offsets(projections), fingerprints, strict=True)
        )
    ]
    if differing:
        raise refuse(
            session,
            channel.rank,
            what,
            round_number,
            f"differs between ranks: rank(s) {differing} were handed another one than rank "
            f"{channel.rank} (each rank's fingerprint of the projection of its sum, all-gathered)",
            differing,
        )
    for part, offset in enumerate(_offsets(projections)):
        total = torch.zeros_like(projections[part])
        size = projections[part].numel() * 8
        for blob in records:
            start = offset + DIGEST_BYTES
            theirs = torch.frombuffer(bytearray(blob[start : start + size]), dtype=torch.int64)
            mod.add_mod_(total, theirs.view_as(total).to(total.device), m.q)
        if not torch.equal(total, expected[part]):
            raise refuse(
                session,
                channel.rank,
                what,
                round_number,
                f"is not the sum of this round's {channel.world_size} inputs (slice {part}: the "
                "random projections of every rank's own input do not add up to the projection of the "
                "sum)",
            )


def check_sliced_sums(
    channel: ShareChannel,
    engine: CkksEngine,
    session: str,
    round_number: int,
    own: Sequence[torch.Tensor],
    mine_index: int,
    mine: torch.Tensor | None,
    prime_ids: Sequence[int],
) -> int:
    """The summed contributions of the sliced path: slice k's sum is on rank k only. Returns this rank's
    verdict on its slice (``SLICE_VERDICTS``: 0 when it holds none or its sum checked out).

    Rank k, once it holds its sum, publishes a fresh 32-byte seed (slice k's challenge: rank k is
    the only one that checks slice k, so its own seed, drawn after the sum arrived, is all the
    randomness the check needs, and no commitment is needed), every rank publishes the projection of
    its own contribution to every slice with that slice's challenge, and rank k checks its slice. The
    verdicts travel with the decoded slices (``aggregate_sliced``): a rank whose slice failed decodes
    nothing and publishes zeros, and every rank then refuses together with ``refuse_sliced``, naming the
    round.
    """
    what = "decryption-contributions"
    ids = tuple(prime_ids)
    m = engine._mod(ids)
    seed = b"" if mine is None else secrets.token_bytes(SEED_BYTES)
    seeds = channel.all_gather_bytes(f"{what}-seed:{round_number}", seed, max_bytes=SEED_BYTES)
    # the ranks holding a slice are the first len(own) (slices are cut in rank order)
    weights = []
    header = f"{len(session)}:{session}/{round_number}/{what}".encode()
    for part, contribution in enumerate(own):
        if len(seeds[part]) != SEED_BYTES:
            raise refuse(
                session, channel.rank, what, round_number, f"was never announced by rank {part}", [part]
            )
        rows = contribution.reshape(-1, len(ids), contribution.size(-1)).size(0)
        challenge = hashlib.sha256(
            CHALLENGE_DOMAIN + len(header).to_bytes(4, "big") + header + seeds[part]
        ).digest()
        weights.append(challenge_weights(challenge, part, m.q, rows))
    projections = [project(o, w, m.q, m.q_inverse) for o, w in zip(own, weights, strict=True)]
    record = b"".join(p.contiguous().cpu().numpy().tobytes() for p in projections)
    records = channel.all_gather_bytes(f"{what}-check:{round_number}", record, max_bytes=len(record))
    if mine is None:
        return 0
    size = projections[mine_index].numel() * 8
    total = torch.zeros_like(projections[mine_index])
    for blob in records:
        start = mine_index * size
        theirs = torch.frombuffer(bytearray(blob[start : start + size]), dtype=torch.int64)
        if theirs.numel() != total.numel():
            return SLICE_TRUNCATED
        mod.add_mod_(total, theirs.view_as(total).to(total.device), m.q)
    if mine.shape != own[mine_index].shape:
        return SLICE_NOT_THE_SUM
    expected, mine_bad = project_checked(mine, weights[mine_index], m.q, m.q_inverse)
    if mine_bad or not torch.equal(total, expected):
        return SLICE_NOT_THE_SUM
    return 0


SLICE_NOT_THE_SUM = 1
SLICE_TRUNCATED = 2
SLICE_VERDICTS = {
    SLICE_NOT_THE_SUM: "is not the sum of this round's contributions",
    SLICE_TRUNCATED: "a rank sent a truncated projection",
}
"""A slice's verdict (``check_sliced_sums``) as it travels with the decoded slices, and its words."""


def refuse_sliced(
    channel: ShareChannel, session: str, round_number: int, verdicts: Sequence[int]
) -> SumCheckError | None:
    """The refusal every rank raises when a rank's verdict on its slice (all-gathered) is not 0."""
    refused = [rank for rank, verdict in enumerate(verdicts) if verdict]
    if not refused:
        return None
    words = SLICE_VERDICTS.get(verdicts[refused[0]], f"was refused (verdict {verdicts[refused[0]]})")
    return refuse(
        session,
        channel.rank,
        "decryption-contributions",
        round_number,
        f"to rank(s) {refused} (the rank(s) decoding those slices) {words}",
        refused,
    )


def _offsets(projections: Sequence[torch.Tensor]) -> list[int]:
    """Where each part's fingerprint starts in a check record (fingerprint, then its projection)."""
    offsets, at = [], 0
    for projection in projections:
        offsets.append(at)
        at += DIGEST_BYTES + projection.numel() * 8
    return offsets


__all__ = [
    "CHALLENGE_COMMIT_DOMAIN",
    "CHALLENGE_DOMAIN",
    "DIGEST_BYTES",
    "SEED_BYTES",
    "SLICE_NOT_THE_SUM",
    "SLICE_TRUNCATED",
    "SLICE_VERDICTS",
    "SUM_CHECK_DOMAIN",
    "SUM_LABELS",
    "SumCheckError",
    "challenge_weights",
    "check_sliced_sums",
    "check_sums",
    "draw_challenge",
    "out_of_range",
    "project",
    "project_checked",
    "projection_weights",
    "refuse",
    "refuse_sliced",
    "seed_commitment",
]
