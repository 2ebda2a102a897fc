"""A t-out-of-N aggregation round that survives ranks leaving (``ThresholdSession.aggregate``, threshold t).

The channel must offer ``gather_members`` (records of whichever members published within the
timeout, through the rendezvous store) and ``sum_members`` (the modular sum among a set of members;
``MemberLostError`` names a member that never arrived or broke the exchange). The round:

1. **Contribute.** Every rank encrypts its whole ciphertext (c0, c1: unlike the N-out-of-N fused
   protocol, an input must survive its owner leaving). The members that arrive within the timeout
   are the contributors C; the ciphertexts are summed among C, and every contributor checks the sum
   (``check_member_sum``: once it holds the sum, C draws a challenge by commit-reveal, bound to the
   session, the round, the attempt and C; the fingerprints of every contributor's projection of the
   sum must agree, and the random projections of every contributor's own ciphertext must add up to
   the projection of the sum; no pass hashes the whole sum). A rank's input counts once its check
   record is in: a rank that leaves before is excluded and the others sum again without it (the
   ciphertexts are reused; the unchecked sum is never decrypted).
2. **Decrypt.** The contributors that arrive form the active set A (|A| ≥ t, else
   ``BelowThresholdError`` naming the missing ranks, on every survivor, after the timeout); each
   publishes h_j = λ_j^A·sk_j·C1 + e_j (its Shamir share scaled by its Lagrange coefficient for A,
   then flooded as in N-out-of-N; on a channel with ``start_sum_members`` the first share's noise is
   drawn while the ciphertext sum is in flight, and serves that share alone), the shares are summed
   among A and checked the same way, and C0 + Σ h_j is decoded (one slice per active rank,
   all-gathered, where the channel can). A member of A that leaves mid-way: the survivors re-choose
   A and publish fresh shares (one more exchange; each spends its rows of the flooding budget).

What a malicious fold can do: the checks refuse a substituted, subset, scaled, negated, replayed or
per-rank different sum, with ``SumCheckError`` naming the round, before any decryption share is
published. It can pretend a rank left (the round then decrypts the others' sum, as a real dropout
would): each rank publishes decryption shares for one checked sum per round, which contains its own
input, so no two sums of one round are ever decrypted and no single input is isolated.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence

import torch

from fhelium.core import Ciphertext
from fhelium.engine import modular as mod
from fhelium.multiparty import shamir
from fhelium.multiparty.channel import MemberLostError
from fhelium.multiparty.encoding import decode_contributions
from fhelium.multiparty.errors import MissingSharesError, MultipartyError
from fhelium.multiparty.state import SessionState
from fhelium.multiparty.sumcheck import (
    DIGEST_BYTES,
    SumCheckError,
    out_of_range,
    project,
    projection_weights,
)

Record = Callable[[str, torch.Tensor], None]


class BelowThresholdError(MissingSharesError):
    """Fewer than t ranks are left to decrypt (or to contribute); ``missing`` names the others."""


def _below(
    session: SessionState, round_number: int, step: str, present: Sequence[int]
) -> BelowThresholdError:
    world, t = session.channel.world_size, session.threshold
    missing = sorted(set(range(world)) - set(present))
    timeout = getattr(session.channel, "timeout_s", None)
    within = f" within {timeout:g}s" if timeout is not None else ""
    return BelowThresholdError(
        f"aggregation round {round_number} of session {session.party.session!r}: t-out-of-N {step} needs {t} "
        f"of {world} ranks; only rank(s) {sorted(present)} arrived{within} (rank(s) {missing} left or "
        "stalled), so the sum cannot be decrypted. Restart the round with at least "
        f"{t} ranks",
        missing,
    )


def _refuse(
    session: SessionState, what: str, round_number: int, detail: str, ranks: Sequence[int] = ()
) -> SumCheckError:
    label = {"ciphertext": "ciphertext sum", "decryption-shares": "sum of the decryption shares"}[what]
    action = "refuses to publish its decryption share" if what == "ciphertext" else "refuses to decode it"
    return SumCheckError(
        f"aggregation round {round_number} of session {session.party.session!r}: the {label} the channel "
        f"(the aggregator's fold) returned {detail}; rank {session.channel.rank} {action}. The aggregator "
        "substituted, dropped, replayed, scaled or reordered inputs, or answered ranks differently "
        "(docs/security.md, 'Threshold aggregation')",
        round_number,
        ranks,
    )


CHALLENGE_COMMIT_DOMAIN = b"fhelium.multiparty.t-of-n-check-commit.v1"
CHALLENGE_DOMAIN = b"fhelium.multiparty.t-of-n-check-challenge.v1"
SEED_BYTES = 32


def _seed_commitment(session: str, round_number: int, binding: str, rank: int, seed: bytes) -> bytes:
    """SHA-256 commitment of ``rank`` to its challenge seed, bound to the session, round and check."""
    header = f"{len(session)}:{session}/{round_number}/{binding}/{rank}".encode()
    return hashlib.sha256(CHALLENGE_COMMIT_DOMAIN + len(header).to_bytes(4, "big") + header + seed).digest()


def draw_member_challenge(
    session: SessionState, what: str, round_number: int, attempt: str, members: Sequence[int]
) -> tuple[bytes, list[int]]:
    """The check's random challenge among ``members``, drawn once this rank holds the sum (commit, reveal).

    Every member commits to a fresh 32-byte seed, then reveals it; the challenge is SHA-256 of the
    seeds in rank order, bound to the session, the round, the check, the attempt and the members.
    The fold fixed every honest member's sum before that member revealed, so the challenge is
    uniform to it. Returns (challenge, members whose commitment or seed never came: they left); a
    seed that does not match its commitment raises ``SumCheckError`` naming the member.
    """
    channel, name = session.channel, session.party.session
    binding = f"{what}:{attempt}:{list(members)}"
    seed = secrets.token_bytes(SEED_BYTES)
    mine = _seed_commitment(name, round_number, binding, channel.rank, seed)
    gather = channel.gather_members  # type: ignore[attr-defined]
    commitments = gather(f"{what}-commit:{attempt}", mine, members, max_bytes=DIGEST_BYTES)
    missing = [rank for rank in members if rank not in commitments]
    if missing:
        return b"", missing
    seeds = gather(f"{what}-reveal:{attempt}", seed, members, max_bytes=SEED_BYTES)
    missing = [rank for rank in members if rank not in seeds]
    if missing:
        return b"", missing
    forged = [
        rank for rank in members
        if len(seeds[rank]) != SEED_BYTES
        or _seed_commitment(name, round_number, binding, rank, seeds[rank]) != commitments[rank]
    ]
    if forged:
        raise _refuse(
            session, what, round_number,
            f"came with challenge seeds of rank(s) {forged} that do not match their commitments (a rank, or "
            "whoever carries the records, changed its seed after seeing the others', or replayed one)",
            forged,
        )
    header = f"{len(name)}:{name}/{round_number}/{binding}".encode()
    joined = b"".join(seeds[rank] for rank in sorted(members))
    return hashlib.sha256(CHALLENGE_DOMAIN + len(header).to_bytes(4, "big") + header + joined).digest(), []


def check_member_sum(
    session: SessionState,
    what: str,
    round_number: int,
    attempt: str,
    own: torch.Tensor,
    summed: torch.Tensor,
    members: Sequence[int],
    prime_ids: Sequence[int],
) -> list[int]:
    """Refuse unless ``summed`` is the same on every member and the sum of the members' ``own``.

    The sum is range-checked, the members draw a challenge (``draw_member_challenge``), and one
    record exchange carries the fingerprint (SHA-256) of this rank's projection of the sum and the
    projection of its own input: the fingerprints must agree (else the ranks were handed different
    sums, or drew different challenges) and the projections of the inputs must add up to the
    projection of the sum. No pass hashes the whole sum. Returns the members whose records never
    came (they left: the caller goes on without them); raises ``SumCheckError`` for a wrong sum.
    """
    channel = session.channel
    ids = tuple(prime_ids)
    m = session.engine._mod(ids)
    if tuple(summed.shape) != tuple(own.shape):
        raise _refuse(session, what, round_number, f"has shape {tuple(summed.shape)}, not {tuple(own.shape)}")
    if summed.numel() and out_of_range(summed.reshape(-1, len(ids), summed.size(-1)), m.q):
        raise _refuse(session, what, round_number, "has residues outside [0, q)")
    challenge, left = draw_member_challenge(session, what, round_number, attempt, members)
    if left:
        return left
    n = own.size(-1)
    rows = own.reshape(-1, len(ids), n).size(0)
    weights = projection_weights(challenge, m.q, rows)
    expected = project(summed, weights, m.q, m.q_inverse)
    fingerprint = hashlib.sha256(challenge + expected.contiguous().cpu().numpy().tobytes()).digest()
    mine = project(own, weights, m.q, m.q_inverse)
    record = fingerprint + mine.contiguous().cpu().numpy().tobytes()
    got = channel.gather_members(f"{what}-check:{attempt}", record, members, max_bytes=len(record))  # type: ignore[attr-defined]
    missing = [rank for rank in members if rank not in got]
    if missing:
        return missing
    differing = [
        rank for rank, blob in got.items() if len(blob) != len(record) or blob[:DIGEST_BYTES] != fingerprint
    ]
    if differing:
        raise _refuse(
            session, what, round_number,
            f"differs between ranks: rank(s) {differing} were handed another one (or another member set) "
            f"than rank {channel.rank}",
            differing,
        )
    total = torch.zeros_like(mine)
    for blob in got.values():
        theirs = torch.frombuffer(bytearray(blob[DIGEST_BYTES:]), dtype=torch.int64).view_as(total)
        mod.add_mod_(total, theirs.to(total.device), m.q)
    if not torch.equal(total, expected):
        raise _refuse(
            session, what, round_number,
            f"is not the sum of this round's inputs of ranks {list(members)} (the random projections of "
            "every rank's own input do not add up to the projection of the sum)",
        )
    return []


def _contribute(
    session: SessionState,
    round_number: int,
    ct: Ciphertext,
    record: Record | None,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[list[int], torch.Tensor, int]:
    """Sum the ciphertexts among whoever is left and check the sum; returns (C, sum, attempts used).

    ``meanwhile()`` runs once, while the first sum is in flight on a channel with
    ``start_sum_members`` (the process group), else before it.
    """
    channel, t = session.channel, session.threshold
    assert t is not None
    moduli = session.engine.moduli_for(ct.prime_ids)
    members = list(session.alive)
    start = getattr(channel, "start_sum_members", None)
    for attempt in range(1, channel.world_size + 2):
        tag = f"{round_number}.{attempt}"
        contributors = sorted(channel.gather_members(f"contribute:{tag}", b"", members))  # type: ignore[attr-defined]
        if len(contributors) < t:
            raise _below(session, round_number, "aggregation", contributors)
        try:
            if start is not None:
                finish = start(f"ciphertext:{tag}", ct.data, moduli, contributors)
                if meanwhile is not None:
                    meanwhile()
                    meanwhile = None
                summed = finish()
            else:
                if meanwhile is not None:
                    meanwhile()
                    meanwhile = None
                summed = channel.sum_members(f"ciphertext:{tag}", ct.data, moduli, contributors)  # type: ignore[attr-defined]
        except MemberLostError as error:
            members = [rank for rank in contributors if rank not in error.missing]
            continue
        if record is not None:
            record("ciphertext_sum", summed)
        left = check_member_sum(
            session, "ciphertext", round_number, tag, ct.data, summed, contributors, ct.prime_ids
        )
        if not left:
            return contributors, summed, attempt
        members = [rank for rank in contributors if rank not in left]
    raise MultipartyError(f"aggregation round {round_number}: the contributors never settled")


def _decrypt(
    session: SessionState,
    round_number: int,
    summed: Ciphertext,
    contributors: list[int],
    first_attempt: int,
    record: Record | None,
    noise: list[torch.Tensor],
) -> tuple[list[int], torch.Tensor]:
    """Decryption shares of the active contributors, re-choosing the active set when one leaves.

    ``noise`` holds at most one NTT(e') drawn ahead (``ThresholdParty.flooding_noise``): the first
    share takes it out; every later attempt draws fresh noise (a share's noise serves it alone).
    """
    channel, party, t = session.channel, session.party, session.threshold
    assert t is not None and session.shamir_share is not None
    moduli = session.engine.moduli_for(summed.prime_ids)
    members = list(contributors)
    for attempt in range(first_attempt + 1, first_attempt + channel.world_size + 2):
        tag = f"{round_number}.{attempt}"
        active = sorted(channel.gather_members(f"decrypt:{tag}", b"", members))  # type: ignore[attr-defined]
        if len(active) < t:
            raise _below(session, round_number, "decryption", active)
        shamir.activate(party, session.shamir_share, active, t)
        try:
            drawn = noise.pop() if noise else None
            share = party.decryption_share(summed, digest=False, noise=drawn).data
        finally:
            party.secret = None  # the Lagrange-scaled share serves this active set only
        if record is not None:
            record("decryption_share", share)
        try:
            total = channel.sum_members(f"shares:{tag}", share, moduli, active)  # type: ignore[attr-defined]
        except MemberLostError as error:
            members = [rank for rank in active if rank not in error.missing]
            continue
        left = check_member_sum(
            session, "decryption-shares", round_number, tag, share, total, active, summed.prime_ids
        )
        if not left:
            if record is not None:
                record("decryption_sum", total)
            return active, total
        members = [rank for rank in active if rank not in left]
    raise MultipartyError(f"aggregation round {round_number}: the decrypting ranks never settled")


def aggregate_surviving(
    session: SessionState,
    values: torch.Tensor,
    *,
    record: Record | None = None,
    before_decrypt: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """One round: the real slots (float64 ``[rows, S]``) of the contributors' sum, and who they are."""
    channel = session.channel
    if session.public is None or session.shamir_share is None:
        raise MultipartyError("t-out-of-N aggregate before generate_public_key (no Shamir share dealt)")
    if not hasattr(channel, "gather_members") or not hasattr(channel, "sum_members"):
        raise MultipartyError(
            f"{type(channel).__name__} cannot exchange among a subset of ranks (gather_members/sum_members): "
            "t-out-of-N aggregation needs a channel that survives ranks leaving"
        )
    values = torch.as_tensor(values)
    if values.ndim == 1:
        values = values.unsqueeze(0)
    session.round += 1
    round_number = session.round
    ct = session.party.encrypt(values, session.public)
    if record is not None:
        record("ciphertext", ct.data)
    noise: list[torch.Tensor] = []

    def draw_noise() -> None:  # independent of the sum: drawn while it is in flight
        noise.append(session.party.flooding_noise(ct.data[1].size(0), ct.prime_ids))

    contributors, summed, attempts = _contribute(session, round_number, ct, record, draw_noise)
    session.alive = contributors
    if before_decrypt is not None:
        before_decrypt()
    total_ct = Ciphertext(summed, ct.depth, ct.scale, ct.prime_ids, "ntt")
    active, shares = _decrypt(session, round_number, total_ct, contributors, attempts, record, noise)
    noise.clear()
    session.alive = active
    return _decode(session, round_number, summed[0], shares, ct, active), contributors


def _decode(
    session: SessionState,
    round_number: int,
    c0: torch.Tensor,
    shares: torch.Tensor,
    ct: Ciphertext,
    active: list[int],
) -> torch.Tensor:
    """C0 + Σ h_j decoded: one slice of rows per active rank, all-gathered, on a channel with
    ``all_gather_members`` (the process group); every row here otherwise, or when a rank leaves now.
    """
    engine, channel = session.engine, session.channel
    q = engine._mod(ct.prime_ids).q
    rows = c0.size(0)
    gather = getattr(channel, "all_gather_members", None)
    if gather is not None and 1 < len(active) <= rows:
        per = -(-rows // len(active))
        start = min(active.index(channel.rank) * per, rows)
        stop = min(start + per, rows)
        decoded = torch.zeros(per, engine.slot_count, dtype=torch.float64)
        if stop > start:  # the phase of this rank's slice only
            phase = mod.add_mod(c0[start:stop], shares[start:stop], q)
            decoded[: stop - start] = decode_contributions(engine, phase, ct.prime_ids, ct.scale)
        try:
            pieces = gather(f"decoded:{round_number}", decoded, active)
            return torch.cat(pieces)[:rows]
        except MemberLostError:
            pass  # a decoder left: this rank holds every row's C0 and Σ h_j and decodes them itself
    return decode_contributions(engine, mod.add_mod(c0, shares, q), ct.prime_ids, ct.scale)


__all__ = ["BelowThresholdError", "aggregate_surviving", "check_member_sum", "draw_member_challenge"]
