"""The fused aggregation protocol pipelined per slice of rows (the process group's road).

``ThresholdSession.aggregate`` (fhelium.multiparty.distributed) runs it on a channel with
``start_all_reduce_residues``, ``start_reduce_residues`` and ``all_gather_tensor``: the rows are cut
into one slice per rank, slice k is encrypted and its c1 sum starts while the next slice is
encrypted, slice k's contributions are summed on rank k only, which checks and decodes it, and the
decoded slices are all-gathered. Functions of the session; the sums are checked with
fhelium.multiparty.sumcheck.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from fhelium.core import Ciphertext
from fhelium.multiparty import sumcheck
from fhelium.multiparty.encoding import decode_contributions
from fhelium.multiparty.state import SessionState


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
    engine = session.engine
    rows, world = values.size(0), session.channel.world_size
    per = -(-rows // world)
    try:
        parts, flooded = _encrypt_slices(session, values, per, record=record, check_sums=check_sums)
        ids = parts[0][1].prime_ids
        sums = _sum_c1_slices(session, parts, round_number, ids, record=record, check_sums=check_sums)
    except BaseException:
        # a c1 sum of this round may still be in flight into a kept copy: never reuse one
        _kept_copies().clear()
        raise
    if before_contribution is not None:
        before_contribution()
    own, mine_index, mine = _reduce_contributions(session,
        parts, sums, flooded, record=record, check_sums=check_sums
    )
    verdict = 0
    if check_sums:
        verdict = sumcheck.check_sliced_sums(
            session.channel, session.engine, session.party.session, round_number, own, mine_index, mine, ids)
    # one row more than the slice: its first entry carries this rank's verdict on its slice, so the
    # verdicts need no exchange of their own; a slice that failed its check is never decoded
    decoded = torch.zeros(per + 1, engine.slot_count, dtype=torch.float64)
    decoded[per, 0] = verdict
    if mine is not None and verdict == 0:
        ct = parts[mine_index][1]
        decoded[: mine.size(0)] = decode_contributions(engine, mine, ct.prime_ids, ct.scale)
    pieces = session.channel.all_gather_tensor("decoded-slots", decoded)  # type: ignore[attr-defined]
    if check_sums:
        verdicts = [int(piece[per, 0]) if piece.size(0) == per + 1 else -1 for piece in pieces]
        refused = sumcheck.refuse_sliced(session.channel, session.party.session, round_number, verdicts)
        if refused is not None:
            raise refused
    return torch.cat([piece[:per] for piece in pieces])[:rows]

def _encrypt_slices(
    session: SessionState,
    values: torch.Tensor,
    per: int,
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    check_sums: bool,
) -> tuple[list[tuple[int, Ciphertext, Callable[[], torch.Tensor]]], list[torch.Tensor]]:
    """Encrypt slice k and start its c1 sum while the next is encrypted; the flooded c0 of each slice."""
    assert session.public is not None
    party, engine = session.party, session.engine
    start_sum = session.channel.start_all_reduce_residues  # type: ignore[attr-defined]
    rows, world = values.size(0), session.channel.world_size
    bounds = [(min(k * per, rows), min((k + 1) * per, rows)) for k in range(world)]
    parts: list[tuple[int, Ciphertext, Callable[[], torch.Tensor]]] = []
    for k, (start, stop) in enumerate(bounds):
        if stop > start:  # the same on every rank: all encrypt the same number of rows
            if record is None:  # c0 comes with the flooding noise in it (encrypt_flooded)
                ct = party.encrypt_flooded(values[start:stop], session.public)
            else:  # the audit sees the ciphertext itself; the noise is added below
                ct = party.encrypt(values[start:stop], session.public)
                record("ciphertext", ct.data)
            moduli = engine.moduli_for(ct.prime_ids)
            # a copy goes to the in-place sum: this rank's own c1 is needed for the check
            sent = ct.data[1]
            if check_sums:
                sent = sent.clone() if record is not None else reusable_copy(k, sent)
            parts.append((k, ct, start_sum("ciphertext-c1", sent, moduli)))
    if record is None:
        flooded = [ct.data[0] for _, ct, _ in parts]
    else:
        flooded = [party.flooded_c0(ct.data[0], ct.prime_ids) for _, ct, _ in parts]
    return parts, flooded

def reusable_copy(slice_index: int, source: torch.Tensor) -> torch.Tensor:
    """``source`` copied into the buffer this thread keeps for slice ``slice_index`` from round to round.

    The copy of c1 that goes to the in-place sum (tens of MiB at 1M values) cost several times its
    memcpy in fresh pages every round (the allocator hands a buffer this large back to the system);
    a kept buffer faults its pages in once, for every session the thread runs. A thread runs one
    round at a time, and a round's sum lives in the buffer only until the round ends (nothing of it
    is returned); a round that fails clears the thread's buffers (``aggregate_sliced``: a collective
    may still be writing into one), and an audited round (``record``, which may keep what it is
    shown) takes a fresh copy instead.
    """
    kept = _kept_copies()
    buffer = kept.get(slice_index)
    layout = (source.shape, source.dtype, source.device)
    if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != layout:
        buffer = torch.empty_like(source, memory_format=torch.contiguous_format)
        kept[slice_index] = buffer
    return buffer.copy_(source)


_THREAD = threading.local()


def _kept_copies() -> dict[int, torch.Tensor]:
    """This thread's kept c1 copies, by slice."""
    kept: dict[int, torch.Tensor] | None = getattr(_THREAD, "c1_copies", None)
    if kept is None:
        kept = _THREAD.c1_copies = {}
    return kept


def _sum_c1_slices(
    session: SessionState,
    parts: Sequence[tuple[int, Ciphertext, Callable[[], torch.Tensor]]],
    round_number: int,
    ids: Sequence[int],
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    check_sums: bool,
) -> list[torch.Tensor]:
    """Each slice's c1 sum as it arrives, then checked (``sumcheck.check_sums``)."""
    sums = []
    for _, _, finish in parts:
        c1 = finish()
        if record is not None:
            record("c1_sum", c1)
        sums.append(c1)
    if check_sums:  # each sum's range is checked in the pass that projects it
        own_parts = [ct.data[1] for _, ct, _ in parts]
        sumcheck.check_sums(
            session.channel, session.engine, session.party.session, "ciphertext-c1", round_number,
            own_parts, sums, ids,
        )
    return sums

def _reduce_contributions(
    session: SessionState,
    parts: Sequence[tuple[int, Ciphertext, Callable[[], torch.Tensor]]],
    sums: Sequence[torch.Tensor],
    flooded: Sequence[torch.Tensor],
    *,
    record: Callable[[str, torch.Tensor], None] | None,
    check_sums: bool,
) -> tuple[list[torch.Tensor], int, torch.Tensor | None]:
    """c0_i + h_i per slice, slice k reduced to rank k; (own contributions kept for the check,
    the index of this rank's slice, its summed contributions or None).
    """
    party, engine = session.party, session.engine
    start_reduce = session.channel.start_reduce_residues  # type: ignore[attr-defined]
    pending = []
    own: list[torch.Tensor] = []
    for (k, ct, _), c1, contribution in zip(parts, sums, flooded, strict=True):
        party.add_decryption_share_(contribution, c1, ct.prime_ids)
        if record is not None:
            record("decryption_share", contribution)
        if check_sums and record is None:  # the reduction works in place; the check needs
            # this rank's own: its c1 has served its check, so its buffer takes the copy
            own.append(ct.data[1].copy_(contribution))
        elif check_sums:  # the audit was shown the ciphertext and may keep it: a fresh copy
            own.append(contribution.clone())
        moduli = engine.moduli_for(ct.prime_ids)
        pending.append(start_reduce("decryption-contributions", contribution, moduli, k))
    mine: torch.Tensor | None = None
    mine_index = -1
    for index, finish in enumerate(pending):
        total = finish()
        if total is not None:
            if record is not None:
                record("decryption_sum", total)
            mine, mine_index = total, index
    return own, mine_index, mine


__all__ = ["aggregate_sliced", "reusable_copy"]
