"""The fused aggregation protocol pipelined per slice of rows (the process group's road).

``ThresholdSession.aggregate`` (fhelium.multiparty.distributed) runs it on a channel with
``start_all_reduce_residues``, ``start_reduce_residues`` and ``all_gather_tensor``: the rows are cut
into one slice per rank, slice k is encrypted and its c1 sum starts while the next slice is
encrypted, slice k's contributions are summed on rank k only, which checks and decodes it, and the
decoded slices are all-gathered. Functions of the session; the sums are checked with
fhelium.multiparty.sumcheck: each rank projects its own c1 and its own contribution of every slice
with the round's secret challenge before they are summed in place, and the masked projections are
summed beside them (one small all-reduce per exchange).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fhelium.core import Ciphertext
from fhelium.multiparty import challenge, sumcheck
from fhelium.multiparty.encoding import decode_contributions
from fhelium.multiparty.state import SessionState

Part = tuple[int, Ciphertext, Callable[[], torch.Tensor]]


@dataclass
class _Checks:
    """One round's checks on this rank: the two challenges, and its refusal of the c1 sum, if any."""

    c1: challenge.RoundChallenge
    contributions: challenge.RoundChallenge
    c1_refusal: sumcheck.SumCheckError | None = None


def aggregate_sliced(
    session: SessionState,
    values: torch.Tensor,
    round_number: int,
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    before_contribution: Callable[[], None] | None,
    check_sums: bool,
) -> torch.Tensor:
    """The fused protocol pipelined per slice of rows (the process group; see ``aggregate``)."""
    engine, channel = session.engine, session.channel
    rows, world = values.size(0), channel.world_size
    per = -(-rows // world)
    part_rows = [count for count in (min(rows, (k + 1) * per) - k * per for k in range(world)) if count > 0]

    def draw_checks(ids: Sequence[int]) -> _Checks:
        c1, contributions = (
            sumcheck.round_challenge(
                session.challenge_key, engine, session.party.session, what, round_number, channel.rank,
                world, ids, part_rows,
            )
            for what in ("ciphertext-c1", "decryption-contributions")
        )
        return _Checks(c1, contributions)

    parts, flooded, masked_c1, checks = _encrypt_slices(
        session, values, per, record=record, draw_checks=draw_checks if check_sums else None
    )
    ids = parts[0][1].prime_ids
    sums = _sum_c1_slices(session, parts, masked_c1, round_number, ids, record=record, checks=checks)
    if before_contribution is not None and (checks is None or checks.c1_refusal is None):
        before_contribution()
    mine_index, mine, verdict = _reduce_contributions(
        session, parts, sums, flooded, round_number, record=record, checks=checks
    )
    # one row more than the slice: its first two entries carry this rank's verdict on its slice and
    # whether it refused its c1 sum, so the verdicts need no exchange of their own; a slice that failed
    # its check is never decoded
    decoded = torch.zeros(per + 1, engine.slot_count, dtype=torch.float64)
    decoded[per, 0] = verdict
    decoded[per, 1] = float(checks is not None and checks.c1_refusal is not None)
    if mine is not None and verdict == 0:
        ct = parts[mine_index][1]
        decoded[: mine.size(0)] = decode_contributions(engine, mine, ct.prime_ids, ct.scale)
    pieces = channel.all_gather_tensor("decoded-slots", decoded)  # type: ignore[attr-defined]
    if checks is not None:
        _refuse_together(session, round_number, checks, pieces, per)
    return torch.cat([piece[:per] for piece in pieces])[:rows]


def _refuse_together(
    session: SessionState, round_number: int, checks: _Checks, pieces: Sequence[torch.Tensor], per: int
) -> None:
    """Every rank refuses a round in which any rank refused its c1 sum or its slice's contributions."""
    if checks.c1_refusal is not None:
        raise checks.c1_refusal
    rank, name = session.channel.rank, session.party.session
    well_formed = [piece.size(0) == per + 1 for piece in pieces]
    refusers = [r for r, piece in enumerate(pieces) if not well_formed[r] or piece[per, 1] != 0]
    if refusers:
        raise sumcheck.refuse(
            name, rank, "ciphertext-c1", round_number,
            f"to rank(s) {refusers} is not the sum of this round's {session.channel.world_size} inputs "
            "(they refused it and published random residues in place of their decryption contributions)",
            refusers,
            action=f"rank {rank}'s own checked out, but it refuses the round's result",
        )
    verdicts = [int(piece[per, 0]) if ok else -1 for piece, ok in zip(pieces, well_formed, strict=True)]
    refused = sumcheck.refuse_sliced(session.channel, name, round_number, verdicts)
    if refused is not None:
        raise refused


def _encrypt_slices(
    session: SessionState,
    values: torch.Tensor,
    per: int,
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    draw_checks: Callable[[Sequence[int]], _Checks] | None,
) -> tuple[list[Part], list[torch.Tensor], Callable[[], torch.Tensor] | None, _Checks | None]:
    """Encrypt slice k and start its c1 sum while the next is encrypted; the flooded c0 of each slice,
    and (checked) the pending sum of every rank's masked projections of its c1 slices and the round's
    checks (``draw_checks`` of the ciphertexts' primes).

    With the checks each slice's c1 is projected before it goes to the in-place sum: no copy is kept.
    """
    assert session.public is not None
    party, engine = session.party, session.engine
    start_sum = session.channel.start_all_reduce_residues  # type: ignore[attr-defined]
    rows, world = values.size(0), session.channel.world_size
    bounds = [(min(k * per, rows), min((k + 1) * per, rows)) for k in range(world)]
    parts: list[Part] = []
    projections = []
    checks = None
    m = None
    for k, (start, stop) in enumerate(bounds):
        if stop > start:  # the same on every rank: all encrypt the same number of rows
            if record is None:  # c0 comes with the flooding noise in it (encrypt_flooded)
                ct = party.encrypt_flooded(values[start:stop], session.public)
            else:  # the audit sees the ciphertext itself; the noise is added below
                ct = party.encrypt(values[start:stop], session.public)
                record("ciphertext", ct.data)
            moduli = engine.moduli_for(ct.prime_ids)
            sent = ct.data[1]
            if draw_checks is not None:
                checks = checks or draw_checks(ct.prime_ids)
                m = engine._mod(ct.prime_ids)
                projections.append(sumcheck.project_own(sent, checks.c1, len(parts), m.q, m.q_inverse))
                if record is not None:  # the audit may keep the ciphertext it was shown
                    sent = sent.clone()
            parts.append((k, ct, start_sum("ciphertext-c1", sent, moduli)))
    masked_c1 = None
    if checks is not None and m is not None:
        masked = challenge.masked(projections, checks.c1, m.q, flagged=False)
        masked_c1 = start_sum("ciphertext-c1-check", masked, engine.moduli_for(parts[0][1].prime_ids))
    if record is None:
        flooded = [ct.data[0] for _, ct, _ in parts]
    else:
        flooded = [party.flooded_c0(ct.data[0], ct.prime_ids) for _, ct, _ in parts]
    return parts, flooded, masked_c1, checks


def _sum_c1_slices(
    session: SessionState,
    parts: Sequence[Part],
    masked_c1: Callable[[], torch.Tensor] | None,
    round_number: int,
    ids: Sequence[int],
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    checks: _Checks | None,
) -> list[torch.Tensor]:
    """Each slice's c1 sum as it arrives, then checked; a failed check sets ``checks.c1_refusal``."""
    sums = []
    for _, _, finish in parts:
        c1 = finish()
        if record is not None:
            record("c1_sum", c1)
        sums.append(c1)
    if checks is not None and masked_c1 is not None:
        summed_masked = masked_c1()
        shapes = [ct.data.shape[1:] for _, ct, _ in parts]
        verdicts = sumcheck.sum_verdicts(
            session.engine, ids, checks.c1, dict(enumerate(sums)), shapes, summed_masked,
            session.channel.world_size,
        )
        failed = [(part, reason) for part, (verdict, reason) in sorted(verdicts.items()) if verdict != 0]
        if failed:
            checks.c1_refusal = sumcheck.refuse(
                session.party.session, session.channel.rank, "ciphertext-c1", round_number, failed[0][1]
            )
    return sums


def _reduce_contributions(
    session: SessionState,
    parts: Sequence[Part],
    sums: Sequence[torch.Tensor],
    flooded: Sequence[torch.Tensor],
    round_number: int,
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    checks: _Checks | None,
) -> tuple[int, torch.Tensor | None, int]:
    """c0_i + h_i per slice, slice k reduced to rank k; (the index of this rank's slice, its summed
    contributions or None, this rank's verdict on it: 0 or a ``sumcheck.SLICE_VERDICTS`` key).

    A rank that refused its c1 sum publishes uniform residues instead (and flags its projections), so
    every rank finishes the round's collectives and all refuse together. Checked, each contribution is
    projected before the in-place reduction, and the masked projections are summed beside them.
    """
    party, engine = session.party, session.engine
    start_reduce = session.channel.start_reduce_residues  # type: ignore[attr-defined]
    refused = checks is not None and checks.c1_refusal is not None
    pending = []
    projections: list[torch.Tensor] = []
    for (k, ct, _), c1, contribution in zip(parts, sums, flooded, strict=True):
        if refused:  # nothing derived from a wrong c1 sum, or from this rank's c0, leaves the rank
            contribution = sumcheck.random_residues(engine, ct.prime_ids, contribution)
        else:
            party.add_decryption_share_(contribution, c1, ct.prime_ids)
        if record is not None:
            record("random_contribution" if refused else "decryption_share", contribution)
        if checks is not None:
            m = engine._mod(ct.prime_ids)
            part = len(projections)
            projections.append(
                sumcheck.project_own(contribution, checks.contributions, part, m.q, m.q_inverse)
            )
        moduli = engine.moduli_for(ct.prime_ids)
        pending.append(start_reduce("decryption-contributions", contribution, moduli, k))
    masked_sum = None
    if checks is not None:
        ids = parts[0][1].prime_ids
        masked = challenge.masked(projections, checks.contributions, engine._mod(ids).q, flagged=refused)
        masked_sum = session.channel.start_all_reduce_residues(  # type: ignore[attr-defined]
            "decryption-contributions-check", masked, engine.moduli_for(ids)
        )
    mine: torch.Tensor | None = None
    mine_index = -1
    for index, finish in enumerate(pending):
        total = finish()
        if total is not None:
            if record is not None:
                record("decryption_sum", total)
            mine, mine_index = total, index
    if checks is None or masked_sum is None:
        return mine_index, mine, 0
    summed_masked = masked_sum()
    if mine is None:
        return mine_index, mine, 0
    shapes = [ct.data.shape[1:] for _, ct, _ in parts]
    verdicts = sumcheck.sum_verdicts(
        engine, parts[0][1].prime_ids, checks.contributions, {mine_index: mine}, shapes, summed_masked,
        session.channel.world_size,
    )
    verdict = verdicts[mine_index][0]
    if verdict == 0:
        return mine_index, mine, 0
    return mine_index, mine, sumcheck.SLICE_FLAGGED if verdict > 0 else sumcheck.SLICE_NOT_THE_SUM


__all__ = ["aggregate_sliced"]
