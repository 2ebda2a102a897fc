"""Verified sums: the checks that a sum the channel's fold returned is the sum of this round's inputs.

The channel's fold is not trusted (docs/security.md, "Threshold aggregation"). The ranks share a
secret challenge key, agreed at key generation (fhelium.multiparty.challenge), from which every check
of every round derives one uniform multiplier per row and limb of each slice and one-time masks.
Before its input is summed (in place) each rank projects it (Σ_r ρ_r·x_r mod q, exact) and hands the
fold the masked projection, summed beside the input (``masked_projections``); once a rank holds a
sum it projects it, range-checking it in the same pass, and the sum of the masked projections, less
the masks' sum, must equal that projection exactly, modulo each prime (``sum_verdicts``). The fold
never sees the multipliers, which change every round. ``ThresholdSession`` (fhelium.multiparty.
distributed, fhelium.multiparty.sliced) runs them; the t-out-of-N round (``fhelium.multiparty.dropout``)
draws its own members-only challenge by commit-reveal (``draw_member_challenge``) and expands it with
``projection_weights``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fhelium.engine import CkksEngine
from fhelium.engine import modular as mod
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty import challenge
from fhelium.multiparty.channel import ShareChannel
from fhelium.multiparty.protocol import MultipartyError

SUM_CHECK_DOMAIN = b"fhelium.multiparty.sum-check.v1"
DIGEST_BYTES = 32


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
    session: str,
    rank: int,
    what: str,
    round_number: int,
    detail: str,
    ranks: Sequence[int] = (),
    action: str | None = None,
) -> SumCheckError:
    """The ``SumCheckError`` of rank ``rank`` refusing the ``what`` sum of round ``round_number``."""
    label = SUM_LABELS.get(what, what)
    if action is None:
        action = (
            "refuses to publish its decryption contribution (it published random residues in its place)"
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


def round_challenge(
    key: bytes | None,
    engine: CkksEngine,
    session: str,
    what: str,
    round_number: int,
    rank: int,
    world: int,
    prime_ids: Sequence[int],
    part_rows: Sequence[int],
) -> challenge.RoundChallenge:
    """This rank's secret challenge for the check of ``what`` in one round (``challenge.round_challenge``).

    ``key`` is the session's challenge key, agreed at ``generate_public_key``.
    """
    if key is None:
        raise MultipartyError(
            "aggregate before the challenge key of the sum checks was agreed: call generate_public_key "
            "first (it agrees the key with the collective public key)"
        )
    return challenge.round_challenge(
        key, session=session, round_number=round_number, what=what, rank=rank, world=world,
        moduli=engine._mod(tuple(prime_ids)).q, part_rows=part_rows, ring_degree=engine.ring_degree,
    )


def masked_projections(
    engine: CkksEngine,
    prime_ids: Sequence[int],
    drawn: challenge.RoundChallenge,
    own: Sequence[torch.Tensor],
    *,
    flagged: bool = False,
) -> torch.Tensor:
    """``[parts, limbs, N]``: the projection of each slice of this rank's own input, masked (``flagged``:
    plus the flag that says this rank refused the c1 sum). Taken before the input is summed in place.
    """
    m = engine._mod(tuple(prime_ids))
    projections = [project_own(o, drawn, part, m.q, m.q_inverse) for part, o in enumerate(own)]
    return challenge.masked(projections, drawn, m.q, flagged=flagged)


def project_own(
    residues: torch.Tensor,
    drawn: challenge.RoundChallenge,
    part: int,
    q: torch.Tensor,
    q_inverse: torch.Tensor,
) -> torch.Tensor:
    """``[limbs, 1]``: slice ``part`` of this rank's input projected over its rows and compressed over its
    coefficients with the round's challenge (what its masked projection carries).
    """
    return challenge.compress(project(residues, drawn.weights[part], q, q_inverse), drawn.coefficients, q)


def sum_verdicts(
    engine: CkksEngine,
    prime_ids: Sequence[int],
    drawn: challenge.RoundChallenge,
    sums: Mapping[int, torch.Tensor],
    own_shapes: Sequence[torch.Size],
    summed_masked: torch.Tensor,
    world: int,
) -> dict[int, tuple[int, str]]:
    """Each held slice's verdict: (``challenge.sum_verdict``, or ``NOT_THE_SUM`` with the reason), by slice.

    ``sums`` maps a slice to the sum this rank holds of it; ``summed_masked`` is the fold's sum of every
    rank's masked projections (``[parts, limbs, N]``). A sum is projected and range-checked in one pass.
    """
    m = engine._mod(tuple(prime_ids))
    parts = len(own_shapes)
    verdicts: dict[int, tuple[int, str]] = {}
    if tuple(summed_masked.shape) != (parts, len(tuple(prime_ids)), 1):
        reason = f"came with a sum of projections of shape {tuple(summed_masked.shape)}"
        return {part: (challenge.NOT_THE_SUM, reason) for part in sums}
    if summed_masked.numel() and out_of_range(summed_masked, m.q):
        return {part: (challenge.NOT_THE_SUM, "came with a sum of projections out of range") for part in sums}
    for part, summed in sums.items():
        if tuple(summed.shape) != tuple(own_shapes[part]):
            verdicts[part] = (
                challenge.NOT_THE_SUM,
                f"has shape {tuple(summed.shape)} where slice {part} has {tuple(own_shapes[part])}",
            )
            continue
        projection, bad = project_checked(summed, drawn.weights[part], m.q, m.q_inverse)
        if bad:  # residues at or above their prime would be congruent to a checked value yet feed the
            # modular kernels out of their range
            verdicts[part] = (challenge.NOT_THE_SUM, f"has residues outside [0, q) in slice {part}")
            continue
        verdict = challenge.sum_verdict(
            challenge.compress(projection, drawn.coefficients, m.q),
            summed_masked[part],
            drawn.total_mask[part],
            drawn.flag[part],
            m.q,
            world,
        )
        verdicts[part] = (
            verdict,
            f"is not the sum of this round's {world} inputs (slice {part}: the secret random projections "
            "of every rank's own input do not add up to the projection of the sum)",
        )
    return verdicts


def refuse_contributions(
    session: str, rank: int, round_number: int, verdict: int, reason: str, world: int
) -> SumCheckError | None:
    """The refusal of a round whose summed contributions got ``verdict`` (``challenge.sum_verdict``) on this
    rank, or None: j > 0 flags say j ranks refused their c1 sum (this rank's checked out).
    """
    if verdict == 0:
        return None
    if verdict > 0:
        return refuse(
            session, rank, "ciphertext-c1", round_number,
            f"to {verdict} rank(s) is not the sum of this round's {world} inputs (they refused it and "
            "published random residues in place of their decryption contributions)",
            action=f"rank {rank}'s own checked out, but it refuses to decode the round",
        )
    return refuse(session, rank, "decryption-contributions", round_number, reason)


def random_residues(engine: CkksEngine, prime_ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Uniform residues shaped as ``like``: what a rank that refused its c1 sum publishes instead of its
    contribution (independent of every secret, so the fold learns nothing from it; it decodes to noise).
    """
    q = engine._mod(tuple(prime_ids)).q.reshape(-1, 1).cpu()
    drawn = RandomSource(purpose="general").uniform_below(q, tuple(like.shape))
    return drawn.to(like.device)


SLICE_NOT_THE_SUM = 1
SLICE_FLAGGED = 3
SLICE_VERDICTS = {
    SLICE_NOT_THE_SUM: "is not the sum of this round's contributions",
    SLICE_FLAGGED: "holds random residues of ranks that refused their c1 sum",
}
"""A slice's verdict (its decoding rank's check) as it travels with the decoded slices, and its words."""


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


__all__ = [
    "DIGEST_BYTES",
    "SLICE_FLAGGED",
    "SLICE_NOT_THE_SUM",
    "SLICE_VERDICTS",
    "SUM_CHECK_DOMAIN",
    "SUM_LABELS",
    "SumCheckError",
    "masked_projections",
    "out_of_range",
    "project",
    "project_checked",
    "project_own",
    "projection_weights",
    "random_residues",
    "refuse",
    "refuse_contributions",
    "refuse_sliced",
    "round_challenge",
    "sum_verdicts",
]
