"""The threshold protocol across processes: a session over a ``ShareChannel``.

``ThresholdSession`` is the facade; its parts live beside it: the channels and their bounded
exchanges (fhelium.multiparty.channel), key generation and t-out-of-N dealing
(fhelium.multiparty.keygen), the checks of the fold's sums (fhelium.multiparty.sumcheck), the
aggregation pipelined per slice (fhelium.multiparty.sliced) and the t-out-of-N round that tolerates
ranks leaving (fhelium.multiparty.dropout). The names those modules exported from here before they
were split off stay importable from here.

Nothing waits forever: a rank that left (after encrypting, say) is named on every remaining rank,
``MissingSharesError: N-out-of-N decryption needs a decryption share from each of 3 ranks; rank(s)
[2] published none within 10s ...`` (fhelium.multiparty.channel).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping

import torch

from fhelium.core import Ciphertext, PublicKey
from fhelium.multiparty import keygen, sumcheck
from fhelium.multiparty.channel import (
    DECRYPTION_EXCHANGES,
    DEFAULT_TIMEOUT_S,
    EXCHANGES,
    MAX_RECORD_BYTES,
    MemberLostError,
    ProcessGroupChannel,
    ShareChannel,
    gather_from_store,
    missing_error,
    require_agreement,
)
from fhelium.multiparty.dealing import DealingIdentity
from fhelium.multiparty.keygen import (
    KEY_SHARE_COMMITMENT_DOMAIN,
    MAX_KEY_SHARE_BYTES,
    key_fingerprint,
    key_share_digest,
)
from fhelium.multiparty.parameters import THRESHOLD_AGGREGATION, ThresholdParameters
from fhelium.multiparty.protocol import (
    MultipartyError,
    ThresholdParty,
    combine_decryption,
    decode_contributions,
)
from fhelium.multiparty.sliced import aggregate_sliced
from fhelium.multiparty.sumcheck import (
    DIGEST_BYTES,
    SUM_CHECK_DOMAIN,
    SUM_LABELS,
    SumCheckError,
    out_of_range,
    project,
    projection_weights,
)
from fhelium.multiparty.values import PublicKeyShare

DECRYPT_AGREEMENT_DOMAIN = b"fhelium.multiparty.decrypt-agreement.v1"


class ThresholdSession:
    """One rank's side of collective key generation and collective decryption over a channel."""

    def __init__(
        self,
        channel: ShareChannel,
        parameters: ThresholdParameters = THRESHOLD_AGGREGATION,
        *,
        session: str = "",
        rng_seed: bytes | int | None = None,
        device: torch.device | str = "cpu",
        threshold: int | None = None,
        dealing_identity: DealingIdentity | None = None,
        dealing_pins: Mapping[int, str] | None = None,
    ) -> None:
        """``threshold`` t (1 ≤ t ≤ world): t-out-of-N keys, dealt at ``generate_public_key``; any t
        surviving ranks then decrypt (``aggregate`` tolerates up to N − t ranks leaving, see
        ``fhelium.multiparty.dropout``). ``None``: N-out-of-N. ``dealing_identity``: this rank's
        X25519 dealing key (default: a fresh one); ``dealing_pins``: rank → SHA-256 hex of its
        dealing public key, refusing any other (``fhelium.multiparty.dealing``).
        """
        self.channel = channel
        self.party = ThresholdParty(
            channel.rank, channel.world_size, parameters, session=session, rng_seed=rng_seed, device=device
        )
        if threshold is not None and not 1 <= threshold <= channel.world_size:
            raise MultipartyError(
                f"threshold must be in [1, {channel.world_size}] (the world size); got {threshold}"
            )
        self.threshold = threshold
        self.dealing_identity = dealing_identity
        self.dealing_pins = dict(dealing_pins or {})
        self.dealing_fingerprint: str | None = None  # hex of the agreed dealing transcript
        # an audit (the flagship's tests) may see each point this rank deals, as (receiver, point)
        self.dealing_audit: Callable[[int, torch.Tensor], None] | None = None
        self.shamir_share: torch.Tensor | None = None  # sk_j = F(x_j), t-out-of-N only
        self.alive: list[int] = list(range(channel.world_size))  # ranks not yet seen leaving
        self.contributors: list[int] = []  # whose inputs the last aggregate's sum covers
        self.engine = self.party.engine
        self.public: PublicKey | None = None
        self.common_seed = b""  # this key generation's common seed (public)
        self.challenge_key: bytes | None = None  # the sum checks' secret (agreed at generate_public_key)
        self.key_share: PublicKeyShare | None = None
        self.round = 0  # aggregation rounds of this session (bound into every sum check)
        self.decryptions = 0  # explicit decrypt() calls of this session

    def generate_public_key(self) -> PublicKey:
        """Seed (commit, reveal, XOR); key shares (commit, sum as residues, open and check); (Σ p_i, a).

        Every rank commits to its key share (SHA-256) before any share moves, the shares are summed
        as residues, and then every share is opened and checked against its commitment and the sum:
        a rank that changed its share after seeing others' (the last hop of a ring all-reduce sees a
        partial sum) is caught, so no rank can steer the collective key to one it alone knows.
        """
        return keygen.generate_public_key(self)

    def encrypt(self, values: torch.Tensor) -> Ciphertext:
        if self.public is None:
            raise MultipartyError("encrypt before generate_public_key")
        return self.party.encrypt(values, self.public)

    def aggregate(
        self,
        values: torch.Tensor,
        *,
        record: Callable[[str, torch.Tensor], None] | None = None,
        before_contribution: Callable[[], None] | None = None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Encrypt this rank's real ``values`` ``[rows, ≤S]``, sum over the ranks, decrypt collectively.

        Returns the real slots (float64 ``[rows, S]``) of the sum, on every rank. The fused protocol:
        the ranks sum only the ciphertexts' c1 components; each rank then publishes c0_i + h_i
        (its own c0 folded into its flooded decryption share of the summed c1), and the sum of
        those is c0 + Σ h_i. Every c0_i is a fresh one-time pad (an RLWE sample) used in exactly one
        contribution, so the only combination of the contributions that decodes is the sum of all of
        them, and it decodes to the sum of the messages only if every rank folded its secret into
        the true c1 sum.

        Verified sums (docs/security.md, "Threshold aggregation"): the channel's fold is not
        trusted. The ranks share a secret challenge key, agreed at ``generate_public_key``
        (fhelium.multiparty.challenge), from which each round derives fresh multipliers (one uniform
        value per row and limb, one per limb and coefficient) and one-time masks. Before its c1 goes
        to the sum each rank projects it to one value per limb and slice, and the masked projections
        are summed beside the c1 components; once a rank holds its c1
        sum it projects that (range-checking it in the same pass) and refuses unless the sum of the
        masked projections, less the masks, equals it exactly, modulo each prime. The fold never
        learns the multipliers, so a substituted ciphertext, a subset sum, an earlier round's sum, a
        scaled or negated sum, or different sums for different ranks pass with probability at most
        2/q ≈ 2^-49 per rank. A rank that refuses publishes uniform residues instead of its
        contribution and flags its projection of them; every rank finishes the round and then refuses
        it with ``SumCheckError`` naming the round. The summed contributions are checked the same way
        before they are decoded (the fold cannot bias the result unnoticed). Rounds are numbered
        within the session.

        On a channel with ``start_all_reduce_residues``, ``start_reduce_residues`` and
        ``all_gather_tensor`` (the process group) the rows are cut into one slice per rank:
        slice k is encrypted and its c1 sum starts while the next slice is encrypted, the flooding
        noise is drawn while the sums are in flight, slice k's contributions are summed on rank k
        only, which checks and decodes it, and the decoded slices are all-gathered (real parts
        only). Other channels (the relay road) sum everything with ``all_reduce_residues`` and every
        rank decodes every row. ``sum_c1(ct)``, when given, sums the c1 components instead of the
        channel (the flagship runs its compiled Program here): it gets this rank's ciphertext with
        c0 zeroed and returns the summed c1 ``[rows, limbs, N]``; the sum is checked all the same.
        ``record(name, tensor)`` sees the ciphertext, the summed c1, this rank's contribution (named
        "random_contribution" when it refused its c1 sum) and the summed contributions this rank
        decodes (the flagship's audit). ``before_contribution()`` runs
        once every c1 sum has arrived and passed its check, before this rank publishes any
        contribution (the flagship's fault injection: a rank leaving after encrypting); a rank whose
        c1 sum failed its check does not run it.

        Each aggregation spends ``rows`` of this key's flooding budget
        (``ThresholdParameters.decryption_row_budget``); past it ``FloodingBudgetError``.

        With t-out-of-N keys (``threshold``) the round tolerates ranks leaving instead
        (``fhelium.multiparty.dropout``): the sum covers the ranks in ``self.contributors``;
        ``before_contribution`` then runs once this rank's input is in the checked sum, before it
        publishes its decryption share; ``sum_c1`` is not supported.
        """
        if self.threshold is not None:
            if sum_c1 is not None:
                raise MultipartyError(
                    "t-out-of-N aggregate sums through the channel: sum_c1 is not supported"
                )
            from fhelium.multiparty.dropout import aggregate_surviving

            total, self.contributors = aggregate_surviving(
                self, values, record=record, before_decrypt=before_contribution
            )
            return total
        self.contributors = list(range(self.channel.world_size))
        return self._aggregate(
            values, record=record, before_contribution=before_contribution, sum_c1=sum_c1, check_sums=True
        )

    def _aggregate(
        self,
        values: torch.Tensor,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        before_contribution: Callable[[], None] | None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None,
        check_sums: bool,
    ) -> torch.Tensor:
        """``aggregate``; ``check_sums=False`` trusts the fold (no sum check, no projections).

        ``check_sums=False`` exists for bench/aggregate.py's baseline only (it measures what the
        defence against a malicious fold costs); nothing else may call it so: an aggregator could
        then decrypt any ciphertext or bias the result unnoticed (docs/security.md).
        """
        if self.public is None:
            raise MultipartyError("aggregate before generate_public_key")
        party, channel = self.party, self.channel
        values = torch.as_tensor(values)
        if values.ndim == 1:
            values = values.unsqueeze(0)
        rows, world = values.size(0), channel.world_size
        self.round += 1
        round_number = self.round
        party.spend_decryption_rows(rows)  # before anything moves: every rank refuses at the same round
        sliced = all(
            hasattr(channel, name)
            for name in ("start_all_reduce_residues", "start_reduce_residues", "all_gather_tensor")
        )
        if sum_c1 is not None or not sliced or world == 1 or rows < world:
            return self._aggregate_blocking(
                values, round_number, record=record, before_contribution=before_contribution,
                sum_c1=sum_c1, check_sums=check_sums,
            )
        return aggregate_sliced(
            self, values, round_number, record=record, before_contribution=before_contribution,
            check_sums=check_sums,
        )

    def _aggregate_blocking(
        self,
        values: torch.Tensor,
        round_number: int,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        before_contribution: Callable[[], None] | None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None,
        check_sums: bool,
    ) -> torch.Tensor:
        """The fused protocol with one sum of each (the relay road, ``sum_c1``, small batches)."""
        assert self.public is not None
        party, engine, channel = self.party, self.engine, self.channel
        ct = party.encrypt(values, self.public)
        ids = ct.prime_ids
        moduli = engine.moduli_for(ids)
        if record is not None:
            record("ciphertext", ct.data)
        own_c1 = ct.data[1]
        checks = None
        if check_sums:  # the round's secret challenges; this rank's c1 projected before it is summed
            checks = [
                sumcheck.round_challenge(
                    self.challenge_key, engine, party.session, what, round_number, channel.rank,
                    channel.world_size, ids, [ct.data.size(1)],
                )
                for what in ("ciphertext-c1", "decryption-contributions")
            ]
            masked_c1 = sumcheck.masked_projections(engine, ids, checks[0], [own_c1])
        if sum_c1 is not None:  # only c1 leaves this rank: c0 is its one-time pad
            c1_only = Ciphertext(
                torch.stack((torch.zeros_like(own_c1), own_c1)), ct.depth, ct.scale, ids, "ntt"
            )
            c1 = sum_c1(c1_only)
        else:
            c1 = channel.all_reduce_residues("ciphertext-c1", own_c1, moduli)
        if record is not None:
            record("c1_sum", c1)
        refusal: SumCheckError | None = None
        if checks is not None:
            summed = channel.all_reduce_residues("ciphertext-c1-check", masked_c1, moduli)
            verdict, reason = sumcheck.sum_verdicts(
                engine, ids, checks[0], {0: c1}, [own_c1.shape], summed, channel.world_size
            )[0]
            if verdict != 0:
                refusal = sumcheck.refuse(party.session, channel.rank, "ciphertext-c1", round_number, reason)
        if refusal is None:
            if before_contribution is not None:
                before_contribution()
            contribution = party.add_decryption_share_(party.flooded_c0(ct.data[0], ids), c1, ids)
        else:  # nothing derived from a wrong c1 sum, or from this rank's c0, leaves the rank
            contribution = sumcheck.random_residues(engine, ids, ct.data[0])
        if record is not None:
            record("decryption_share" if refusal is None else "random_contribution", contribution)
        if checks is not None:
            masked_contribution = sumcheck.masked_projections(
                engine, ids, checks[1], [contribution], flagged=refusal is not None
            )
        total = channel.all_reduce_residues("decryption-contributions", contribution, moduli)
        if record is not None:
            record("decryption_sum", total)
        if checks is not None:
            tag = "decryption-contributions-check"
            summed = channel.all_reduce_residues(tag, masked_contribution, moduli)
            if refusal is not None:
                raise refusal
            verdict, reason = sumcheck.sum_verdicts(
                engine, ids, checks[1], {0: total}, [contribution.shape], summed, channel.world_size
            )[0]
            refused = sumcheck.refuse_contributions(
                party.session, channel.rank, round_number, verdict, reason, channel.world_size
            )
            if refused is not None:
                raise refused
        return decode_contributions(engine, total, ids, ct.scale)

    def decrypt(
        self,
        ct: Ciphertext,
        *,
        assume_identical: bool = False,
        record: Callable[[str, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Publish h_i = s_i·c1 + e_i' for ``ct``, all-reduce the shares, decode c0 + Σ h_i.

        NOT for aggregation: use ``aggregate``. A decryption share decrypts whatever ciphertext it
        is made for, so publishing one for a ciphertext an aggregator handed over lets that
        aggregator decrypt anything it likes (rank v's own ciphertext instead of the sum, for one).
        ``decrypt`` therefore refuses unless the caller states ``assume_identical=True``: that
        ``ct`` is a ciphertext every rank already holds identically *and whose contents every rank
        may learn* (it did not come from a party the ranks do not trust). The ranks then
        all-gather the ciphertext's digest and refuse, naming the ranks, unless all hold the same.

        The result: complex128 slots ``[*batch, S]`` on every rank. Every rank's share covers every
        row; the decoding is split on a channel with ``all_gather_tensor`` (the process group):
        rank r decodes the r-th 1/world of the rows and the decoded slots are all-gathered.
        ``record(name, tensor)`` sees this rank's decryption share and the summed shares. Spends
        the ciphertext's rows of this key's flooding budget.

        With t-out-of-N keys (``threshold``) ``decrypt`` refuses: a rank holds only its Shamir share,
        and a Lagrange-scaled share of it is published only for a sum that ``aggregate`` checked
        contains this rank's own input (so no other ciphertext is ever decrypted with it).
        """
        if self.threshold is not None:
            raise MultipartyError(
                f"ThresholdSession.decrypt with t-out-of-N keys (threshold {self.threshold}) is refused: "
                "this rank publishes a Lagrange-scaled decryption share only for a ciphertext sum that "
                "ThresholdSession.aggregate checked contains its own input; a share for any other ciphertext "
                "would let whoever collects t of them decrypt it. Use aggregate, or N-out-of-N keys "
                "(threshold=None) for decrypt(ct, assume_identical=True)"
            )
        if not assume_identical:
            raise MultipartyError(
                "ThresholdSession.decrypt publishes a decryption share for the ciphertext it is given, which "
                "decrypts that ciphertext for whoever collects the shares: never call it on a ciphertext an "
                "aggregator returned (use ThresholdSession.aggregate, which checks the sums). Pass "
                "assume_identical=True only for a ciphertext every rank holds identically and may see "
                "decrypted"
            )
        engine = self.engine
        self.decryptions += 1
        session = self.party.session
        header = f"{len(session)}:{session}/{self.decryptions}/{ct.prime_ids}/{tuple(ct.data.shape)}"
        digest = hashlib.sha256(
            DECRYPT_AGREEMENT_DOMAIN + header.encode() + ct.data.contiguous().cpu().numpy().tobytes()
        ).digest()
        require_agreement(
            self.channel,
            f"decryption-agreement:{self.decryptions}",
            digest,
            lambda differing: MultipartyError(
                f"decryption {self.decryptions} of session {session!r} was refused before any share "
                f"moved: rank(s) {differing} hold another ciphertext than rank {self.channel.rank} (decrypt "
                "needs the same ciphertext on every rank)"
            ),
        )
        share = self.party.decryption_share(ct, digest=False)
        if record is not None:
            record("decryption_share", share.data)
        moduli = engine.moduli_for(ct.prime_ids)
        total = self.channel.all_reduce_residues("decryption-shares", share.data, moduli)
        if record is not None:
            record("decryption_sum", total)
        gather = getattr(self.channel, "all_gather_tensor", None)
        world, rows = self.channel.world_size, math.prod(ct.batch_shape)
        if gather is None or world == 1 or rows < world:
            return self.party.combine_decryption(ct, total)
        per = -(-rows // world)
        start, stop = min(self.channel.rank * per, rows), min((self.channel.rank + 1) * per, rows)
        limbs, n = ct.data.shape[-2:]
        slots = torch.zeros(per, engine.slot_count, dtype=torch.complex128)
        if stop > start:
            part = Ciphertext(
                ct.data.reshape(2, rows, limbs, n)[:, start:stop], ct.depth, ct.scale, ct.prime_ids, "ntt"
            )
            summed = total.reshape(rows, limbs, n)[start:stop]
            slots[: stop - start] = combine_decryption(engine, part, summed)
        pieces = gather("decoded-slots", torch.view_as_real(slots))
        decoded = torch.view_as_complex(torch.cat(pieces)[:rows].contiguous())
        return decoded.view(*ct.batch_shape, engine.slot_count)


__all__ = [
    "DECRYPTION_EXCHANGES",
    "DEFAULT_TIMEOUT_S",
    "DIGEST_BYTES",
    "EXCHANGES",
    "KEY_SHARE_COMMITMENT_DOMAIN",
    "MAX_KEY_SHARE_BYTES",
    "MAX_RECORD_BYTES",
    "SUM_CHECK_DOMAIN",
    "SUM_LABELS",
    "MemberLostError",
    "ProcessGroupChannel",
    "ShareChannel",
    "SumCheckError",
    "ThresholdSession",
    "gather_from_store",
    "key_fingerprint",
    "key_share_digest",
    "missing_error",
    "out_of_range",
    "project",
    "projection_weights",
]
