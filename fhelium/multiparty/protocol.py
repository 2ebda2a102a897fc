"""N-out-of-N threshold CKKS (Mouchet, Troncoso-Pastoriza, Bossuat, Hubaux, PETS 2021), in process.

One ``ThresholdParty`` per party. The protocol, as the distributed driver runs it:

1. Common seed: every party ``commit_seed()``s (SHA-256 over its rank, the world size, the session
   and a 32-byte contribution), all commitments are exchanged, then every party
   ``reveal_seed()``s; ``combine_seed`` refuses a reveal that does not open its rank's commitment
   and returns the XOR of the contributions. No party chooses the seed: the last to reveal has
   already committed.
2. Collective public key: ``key_share(seed)`` samples s_i and publishes p_i = −a·s_i + e_i, with
   ``a`` expanded from the seed; ``combine_public_key`` gives (Σ p_i, a), a normal ``PublicKey``
   of the collective secret s = Σ s_i, which no party holds.
3. Encrypt with the engine (``encrypt_values``: the message scale 2^88 is encoded in two steps).
4. Collective decryption: ``decryption_share(ct)`` gives h_i = s_i·c1 + e_i' with flooding noise
   e_i' (see parameters.py); ``combine_decryption(ct, Σ h_i)`` decodes c0 + Σ h_i = m + e + Σ e_i'.
   Any N−1 shares leave −s_j·c1 in the sum, which is uniform-looking noise.

The message codec and the residue reductions live in fhelium.multiparty.encoding, the errors in
fhelium.multiparty.errors; this module re-exports their names (their ``__all__`` lists, whole).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from fhelium.core import Ciphertext, ParameterMismatchError, PublicKey
from fhelium.engine import CkksEngine
from fhelium.engine import modular as mod
from fhelium.engine.parameters import ERROR_STANDARD_DEVIATION
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty.encoding import *  # noqa: F403
from fhelium.multiparty.encoding import (
    BLOCK_ROWS,
    ciphertext_digest,
    combine_decryption,
    encrypt_values,
    reduce_signed,
    sum_every_party,
)
from fhelium.multiparty.encoding import __all__ as _encoding_all
from fhelium.multiparty.errors import *  # noqa: F403
from fhelium.multiparty.errors import FloodingBudgetError, MultipartyError, SeedCommitmentError
from fhelium.multiparty.errors import __all__ as _errors_all
from fhelium.multiparty.noise import smudging_noise_from_words
from fhelium.multiparty.parameters import THRESHOLD_AGGREGATION, ThresholdParameters
from fhelium.multiparty.values import (
    SEED_BYTES,
    DecryptionShare,
    PublicKeyShare,
    SecretKeyShare,
    SeedCommitment,
    SeedReveal,
)

COMMITMENT_DOMAIN = b"fhelium.multiparty.seed-commitment.v1"



def commitment_digest(party: int, parties: int, session: str, contribution: bytes) -> bytes:
    """SHA-256 over a domain label, the rank, the world size, the session and the contribution.

    Binding the rank means a party cannot copy another's commitment and reveal the same
    contribution (which would cancel it out of the XOR).
    """
    header = f"{party}/{parties}/{len(session)}:{session}".encode()
    return hashlib.sha256(COMMITMENT_DOMAIN + len(header).to_bytes(4, "big") + header + contribution).digest()


def combine_seed(
    commitments: Sequence[SeedCommitment], reveals: Sequence[SeedReveal], *, parties: int, session: str
) -> bytes:
    """XOR of every opened contribution; refuses any reveal that does not match its commitment."""
    for kind, records in (("commitment", commitments), ("reveal", reveals)):
        by_rank = sorted(record.party for record in records)
        if by_rank != list(range(parties)):
            missing = sorted(set(range(parties)) - set(by_rank))
            raise SeedCommitmentError(
                f"the common seed needs one seed {kind} from each of {parties} ranks; got ranks {by_rank}"
                + (f" (rank(s) {missing} missing)" if missing else " (duplicates)")
            )
        for record in records:
            if record.parties != parties or record.session != session:
                raise SeedCommitmentError(
                    f"rank {record.party}'s seed {kind} is for {record.parties} parties / session "
                    f"{record.session!r}, not {parties} / {session!r}"
                )
    committed = {c.party: c.digest for c in commitments}
    wrong = [
        r.party for r in reveals
        if commitment_digest(r.party, parties, session, r.contribution) != committed[r.party]
    ]
    if wrong:
        raise SeedCommitmentError(
            f"rank(s) {sorted(wrong)} revealed a seed contribution that does not match the commitment they "
            "published first; the common seed is refused (a party that sees the others' contributions before "
            "choosing its own could choose the key's uniform part). Restart key generation"
        )
    seed = bytearray(SEED_BYTES)
    for reveal in reveals:
        for index, byte in enumerate(reveal.contribution):
            seed[index] ^= byte
    return bytes(seed)


def common_uniform(engine: CkksEngine, seed: bytes) -> torch.Tensor:
    """The collective key's uniform ``a`` over every QP prime, NTT domain, from the public seed."""
    ids = tuple(range(len(engine.moduli)))
    q = engine._mod(ids).q
    return (
        RandomSource(seed, purpose="common_uniform")
        .uniform_below(q.cpu(), (len(ids), engine.ring_degree))
        .to(engine.device)
    )


def combine_public_key(
    engine: CkksEngine,
    shares: Sequence[PublicKeyShare] | torch.Tensor,
    seed: bytes,
    *,
    parties: int | None = None,
) -> PublicKey:
    """(Σ p_i, a): the collective public key. ``shares`` may be the already summed residues."""
    ids = tuple(range(len(engine.moduli)))
    q = engine._mod(ids).q
    if isinstance(shares, torch.Tensor):
        total = shares.to(engine.device)
    else:
        if not shares:
            raise MultipartyError("combine_public_key needs at least one share")
        shape = (len(ids), engine.ring_degree)
        total = sum_every_party("public key", shares, parties, q, shape, seed=seed, prime_ids=ids)
    return PublicKey(torch.stack((total, common_uniform(engine, seed))), ids, modulus_basis="QP")



def smudging_noise(source: RandomSource, count: int, parameters: ThresholdParameters) -> torch.Tensor:
    """``count`` flooding-noise integers 2^shift·Y1 + Y2 (int64), Y1/Y2 rounded untruncated Gaussians.

    One Box–Muller pair per sample (``2·count`` keystream words, one draw of ``source``): its cosine
    half gives Y1 and its sine half Y2 (independent standard normals). Box–Muller on 53-bit uniforms
    reaches at most √(2·ln 2^54) ≈ 8.66 σ; the tail it cannot draw has mass below 2^-57 per sample.
    The arithmetic is fhelium.multiparty.noise's (exactly rounded steps, native kernel or its
    pure-torch reference, the same bits).
    """
    return smudging_noise_from_words(
        source.words(2 * count),
        parameters.smudging_shift_bits,
        parameters.smudging_high_sigma,
        parameters.smudging_low_sigma,
    )


def noise_to_ntt(engine: CkksEngine, noise: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
    """Signed noise ``[rows, N]`` (|x| < 2^62) → its residues' NTT ``[rows, limbs, N]`` over ``prime_ids``.

    The native ``signed_ntt`` (residue and transform in one pass) where the engine's NTT is native,
    else ``reduce_signed`` and the NTT: the same residues (they are unique), so the same bits.
    """
    ids = tuple(prime_ids)
    if engine.ntt.native_level != "torch" and noise.device.type == "cpu":
        from fhelium import native

        return native.signed_ntt(noise, *engine.ntt._native_tables(ids), engine.ntt.native_level)
    q = engine._mod(ids)
    return engine.ntt.forward(reduce_signed(noise.unsqueeze(-2), q.q, q.q_inverse), ids)


class ThresholdParty:
    """One party's state: its engine (own randomness), secret share and the protocol's steps."""

    def __init__(
        self,
        party: int,
        parties: int,
        parameters: ThresholdParameters = THRESHOLD_AGGREGATION,
        *,
        session: str = "",
        rng_seed: bytes | int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 <= party < parties:
            raise MultipartyError(f"party {party} is outside [0, {parties})")
        if parties > parameters.max_parties:
            raise MultipartyError(
                f"these threshold parameters are sized for at most {parameters.max_parties} parties; got "
                f"{parties}"
            )
        self.party = party
        self.parties = parties
        self.parameters = parameters
        self.session = session
        self.engine = CkksEngine(parameters.ckks, rng_seed=rng_seed, device=device)
        self._contribution: bytes | None = None
        self.secret: SecretKeyShare | None = None
        self.decrypted_rows = 0  # decryption shares (ciphertext rows) published under this key share

    def spend_decryption_rows(self, rows: int) -> None:
        """Count ``rows`` decryption shares against the flooding budget, or refuse before publishing any.

        Each published row spends at most 2^-λ (λ = ``statistical_security``) of statistical distance
        on the key share; past ``parameters.decryption_row_budget`` rows the party refuses.
        """
        budget = self.parameters.decryption_row_budget
        if self.decrypted_rows + rows > budget:
            raise FloodingBudgetError(
                f"party {self.party}: decrypting {rows} more ciphertext row(s) would exceed this key share's "
                f"flooding budget of {budget} rows ({self.decrypted_rows} spent; each row costs up to "
                f"2^-{self.parameters.statistical_security} of statistical distance, "
                "docs/fhelium-multiparty.md 'Flooding budget'). Rotate the keys: start a new session (or "
                "call generate_public_key again) so that every rank draws a fresh key share"
            )
        self.decrypted_rows += rows

    # ------------------------------------------------------------------ common seed
    def commit_seed(self) -> SeedCommitment:
        draw = self.engine.random.stream("seed_contribution").uniform_below(
            torch.tensor([256]), (SEED_BYTES,)
        )
        self._contribution = bytes(draw.to(torch.uint8).tolist())
        digest = commitment_digest(self.party, self.parties, self.session, self._contribution)
        return SeedCommitment(self.party, self.parties, self.session, digest)

    def reveal_seed(self) -> SeedReveal:
        if self._contribution is None:
            raise MultipartyError(
                "reveal_seed before commit_seed: commit first, reveal after every commitment arrived"
            )
        return SeedReveal(self.party, self.parties, self.session, self._contribution)

    def combine_seed(self, commitments: Sequence[SeedCommitment], reveals: Sequence[SeedReveal]) -> bytes:
        return combine_seed(commitments, reveals, parties=self.parties, session=self.session)

    # ------------------------------------------------------------------ keys
    def key_share(self, seed: bytes) -> PublicKeyShare:
        """Sample s_i (ternary) and return p_i = −a·s_i + e_i over QP."""
        engine = self.engine
        secret = engine.generate_secret_key()
        ids = secret.prime_ids
        self.secret = SecretKeyShare(secret.data, ids, self.party, self.parties)
        self.decrypted_rows = 0  # a fresh key share has its whole flooding budget
        m = engine._mod(ids)
        a = common_uniform(engine, seed)
        e = (
            engine.random.stream("error")
            .gaussian((engine.ring_degree,), ERROR_STANDARD_DEVIATION)
            .to(engine.device)
        )
        e_ntt = engine.ntt.forward(engine._small_to_rns(e, ids), ids)
        p = mod.sub_mod(e_ntt, mod.mul_mod(a, secret.data, m.q, m.q_inverse), m.q)
        return PublicKeyShare(p, ids, self.party, self.parties, seed)

    def combine_public_key(self, shares: Sequence[PublicKeyShare] | torch.Tensor, seed: bytes) -> PublicKey:
        return combine_public_key(self.engine, shares, seed, parties=self.parties)

    # ------------------------------------------------------------------ encrypt / decrypt
    def encrypt(self, values: torch.Tensor, public: PublicKey) -> Ciphertext:
        return encrypt_values(self.engine, values, public, self.parameters)

    def encrypt_flooded(self, values: torch.Tensor, public: PublicKey) -> Ciphertext:
        """``encrypt`` with this party's flooding noise e_i' already added to c0: (c0_i + NTT(e_i'), c1_i).

        For the fused protocol (``ThresholdSession.aggregate``), where c0_i is never published on
        its own: only c1_i (summed) and c0_i + h_i are. The noise is drawn from the ``smudging``
        stream once per encryption group of rows and added in the coefficient domain, where it
        rides in ModDown's forward NTT with e0 (no transform of its own, unlike ``flooded_c0``).
        With groups of ``BLOCK_ROWS`` rows (the threshold preset's) the draws and so the result
        are bit for bit ``flooded_c0(encrypt(values).data[0])``.
        """
        n = self.engine.ring_degree
        source = self.engine.random.stream("smudging")

        def noise(rows: int) -> torch.Tensor:
            return smudging_noise(source, rows * n, self.parameters).view(rows, n)

        return encrypt_values(self.engine, values, public, self.parameters, c0_noise=noise)

    def flooding_noise(self, rows: int, prime_ids: Sequence[int]) -> torch.Tensor:
        """NTT(e_i') ``[rows, limbs, N]``: fresh flooding noise for exactly one decryption share.

        Drawn ahead of the share (t-out-of-N aggregation draws it while the ciphertext sum is in
        flight) from the ``smudging`` stream, ``BLOCK_ROWS`` rows at a time as ``decryption_share``
        does. The caller hands it to one ``decryption_share(noise=...)`` and drops it: two shares
        with the same noise would reveal the difference of their products.
        """
        engine = self.engine
        ids = tuple(prime_ids)
        n = engine.ring_degree
        out = torch.empty((rows, len(ids), n), dtype=torch.int64, device=engine.device)
        source = engine.random.stream("smudging")
        for start in range(0, rows, BLOCK_ROWS):
            count = min(BLOCK_ROWS, rows - start)
            noise = smudging_noise(source, count * n, self.parameters).view(-1, n).to(engine.device)
            out[start : start + count] = noise_to_ntt(engine, noise, ids)
        return out

    def decryption_share(
        self, ct: Ciphertext, *, digest: bool = True, noise: torch.Tensor | None = None
    ) -> DecryptionShare:
        """h_i = s_i·c1 + e_i' in the NTT domain over the ciphertext's primes.

        Computed ``BLOCK_ROWS`` batch rows at a time (product, flooding noise, its residues and NTT,
        sum), so the temporaries stay in cache; the noise is drawn from the fixed sampler's
        ``smudging`` stream block by block (same distribution, one keystream nonce per block).
        ``noise``, when given, is NTT(e_i') drawn ahead by ``flooding_noise`` for this share alone
        (it is consumed: the share is written into it).
        """
        if self.secret is None:
            raise MultipartyError("decryption_share before key_share: this party holds no secret share")
        engine = self.engine
        ct = engine._check_ciphertext(ct, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", components=2, name="decryption_share input")
        self.spend_decryption_rows(math.prod(ct.batch_shape))
        ids = ct.prime_ids
        q = engine._mod(ids)
        n = engine.ring_degree
        s = self.secret.data[list(ids)]
        batch = ct.batch_shape
        c1 = ct.data[1].reshape(-1, len(ids), n)
        if noise is not None:
            if tuple(noise.shape) != tuple(c1.shape) or noise.dtype != torch.int64:
                raise ParameterMismatchError(
                    f"flooding noise of shape {tuple(noise.shape)} does not match the ciphertext's c1 "
                    f"{tuple(c1.shape)}"
                )
            share = noise
            for start in range(0, c1.size(0), BLOCK_ROWS):
                stop = start + BLOCK_ROWS
                mod.add_mod_(share[start:stop], mod.mul_mod(c1[start:stop], s, q.q, q.q_inverse), q.q)
        else:
            share = torch.empty(c1.shape, dtype=torch.int64, device=c1.device)
            source = engine.random.stream("smudging")
            for start in range(0, c1.size(0), BLOCK_ROWS):
                rows = c1[start : start + BLOCK_ROWS]
                product = mod.mul_mod(rows, s, q.q, q.q_inverse)
                drawn = smudging_noise(source, rows.size(0) * n, self.parameters).view(-1, n).to(c1.device)
                noise_ntt = noise_to_ntt(engine, drawn, ids)
                share[start : start + rows.size(0)] = mod.add_mod(product, noise_ntt, q.q)
        marker = ciphertext_digest(ct) if digest else bytes(32)
        return DecryptionShare(
            share.view(*batch, len(ids), n), ids, ct.depth, ct.scale, self.party, self.parties, marker
        )

    def flooded_c0(self, c0: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """c0_i + NTT(e_i'): the part of this party's decryption contribution that needs no c1.

        ``c0`` is this party's own ciphertext's first component ``[rows, limbs, N]`` (NTT domain);
        e_i' is fresh flooding noise from the ``smudging`` stream, drawn ``BLOCK_ROWS`` rows at a
        time as in ``decryption_share``. It can be computed while the c1 sum is still in flight.
        """
        engine = self.engine
        ids = tuple(prime_ids)
        q = engine._mod(ids)
        n = engine.ring_degree
        rows = c0.reshape(-1, len(ids), n)
        out = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
        source = engine.random.stream("smudging")
        for start in range(0, rows.size(0), BLOCK_ROWS):
            block = rows[start : start + BLOCK_ROWS]
            noise = smudging_noise(source, block.size(0) * n, self.parameters).view(-1, n).to(rows.device)
            noise_ntt = noise_to_ntt(engine, noise, ids)
            out[start : start + block.size(0)] = mod.add_mod(block, noise_ntt, q.q)
        return out.view(c0.shape)

    def add_decryption_share_(
        self, flooded: torch.Tensor, c1_sum: torch.Tensor, prime_ids: Sequence[int]
    ) -> torch.Tensor:
        """In place: ``flooded`` (from ``flooded_c0``) += s_i·c1, giving c0_i + h_i.

        ``c1_sum`` is the second component of the *summed* ciphertext (Σ_j c1_j, NTT domain), so
        the result is c0_i + s_i·Σ_j c1_j + e_i': this party's own c0 folded into its decryption
        share. The sum over all parties is c0 + Σ h_i (decodes to the sum of the messages); any
        N−1 of them leave −s_j·c1 + c0_j of the missing party j, which is noise.
        """
        if self.secret is None:
            raise MultipartyError("a decryption share before key_share: this party holds no secret share")
        engine = self.engine
        ids = tuple(prime_ids)
        q = engine._mod(ids)
        n = engine.ring_degree
        if flooded.shape != c1_sum.shape or flooded.size(-2) != len(ids) or flooded.size(-1) != n:
            raise ParameterMismatchError(
                f"c1 sum of shape {tuple(c1_sum.shape)} does not match this party's c0 {tuple(flooded.shape)}"
            )
        s = self.secret.data[list(ids)]
        out = flooded.view(-1, len(ids), n)
        c1 = c1_sum.reshape(-1, len(ids), n)
        for start in range(0, out.size(0), BLOCK_ROWS):
            stop = start + BLOCK_ROWS
            mod.add_mod_(out[start:stop], mod.mul_mod(c1[start:stop], s, q.q, q.q_inverse), q.q)
        return flooded

    def decryption_contribution(self, ct: Ciphertext, c1_sum: torch.Tensor) -> torch.Tensor:
        """c0_i + s_i·c1 + e_i' for this party's own ciphertext ``ct`` and the summed c1.

        The fused form of publishing c0_i (in the ciphertext sum) and h_i (the decryption share):
        it is a function of those two, so it tells any observer no more than they did, and the
        ciphertext sum then needs only its c1 component (half the bytes).
        """
        ct = self.engine._check_ciphertext(ct, "ciphertext")
        ct.assert_state(polynomial_domain="ntt", components=2, name="decryption_contribution input")
        if self.secret is None:
            raise MultipartyError("a decryption share before key_share: this party holds no secret share")
        self.spend_decryption_rows(math.prod(ct.batch_shape))
        flooded = self.flooded_c0(ct.data[0], ct.prime_ids)
        return self.add_decryption_share_(flooded, c1_sum, ct.prime_ids)

    def combine_decryption(
        self, ct: Ciphertext, shares: Sequence[DecryptionShare] | torch.Tensor
    ) -> torch.Tensor:
        return combine_decryption(self.engine, ct, shares, parties=self.parties)


# encoding's and errors' names are protocol's too (code written before the split imports them from here):
# their `__all__` lists, whole (the star imports above bring exactly those names in).
__all__ = [
    "COMMITMENT_DOMAIN",
    "ThresholdParty",
    "combine_public_key",
    "combine_seed",
    "commitment_digest",
    "common_uniform",
    "noise_to_ntt",
    "smudging_noise",
    *_encoding_all,
    *_errors_all,
]
