"""Collective key generation over a channel: the common seed, the public key, t-out-of-N dealing.

The steps of ``ThresholdSession.generate_public_key`` (fhelium.multiparty.distributed), as
functions of the session: the seed is committed and revealed, the key shares are committed,
summed as residues, opened and checked, and with a threshold each rank's Shamir points are dealt,
sealed to each receiver's dealing key (fhelium.multiparty.dealing).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fhelium.core import PublicKey
from fhelium.multiparty import challenge, dealing, shamir
from fhelium.multiparty.channel import ShareChannel, require_agreement
from fhelium.multiparty.protocol import MultipartyError
from fhelium.multiparty.state import SessionState
from fhelium.multiparty.values import PublicKeyShare, SeedCommitment, SeedReveal
from fhelium.serialization import value_from_bytes, value_to_bytes

MAX_KEY_SHARE_BYTES = 1 << 20  # a serialized PublicKeyShare (3 primes x 8192 x 8 bytes + header) fits
KEY_SHARE_COMMITMENT_DOMAIN = b"fhelium.multiparty.key-share-commitment.v1"


def key_share_digest(party: int, parties: int, session: str, serialized_share: bytes) -> bytes:
    """SHA-256 commitment to a serialized PublicKeyShare, bound to the rank, world size and session."""
    header = f"{party}/{parties}/{len(session)}:{session}".encode()
    return hashlib.sha256(
        KEY_SHARE_COMMITMENT_DOMAIN + len(header).to_bytes(4, "big") + header + serialized_share
    ).digest()


def key_fingerprint(public: PublicKey) -> str:
    return hashlib.sha256(public.data.contiguous().cpu().numpy().tobytes()).hexdigest()


def _gather_values(channel: ShareChannel, tag: str, value: SeedCommitment | SeedReveal) -> list[Any]:
    blobs = channel.all_gather_bytes(tag, value_to_bytes(value))
    values = []
    for rank, blob in enumerate(blobs):
        received = value_from_bytes(blob, expected_type=type(value).__name__)
        if getattr(received, "party", None) != rank:
            raise MultipartyError(
                f"rank {rank} sent a {type(value).__name__} for party {getattr(received, 'party', None)}"
            )
        values.append(received)
    return values

def generate_public_key(session: SessionState) -> PublicKey:
    """Seed (commit, reveal, XOR); key shares (commit, sum as residues, open and check); (Σ p_i, a).

    Every rank commits to its key share (SHA-256) before any share moves, the shares are summed
    as residues, and then every share is opened and checked against its commitment and the sum:
    a rank that changed its share after seeing others' (the last hop of a ring all-reduce sees a
    partial sum) is caught, so no rank can steer the collective key to one it alone knows.
    """
    party = session.party
    commitments = _gather_values(session.channel, "seed-commitment", party.commit_seed())
    reveals = _gather_values(session.channel, "seed-reveal", party.reveal_seed())
    seed = party.combine_seed(commitments, reveals)
    share = session.key_share = party.key_share(seed)
    blob = value_to_bytes(share, engine=session.engine)
    digest = key_share_digest(session.channel.rank, session.channel.world_size, party.session, blob)
    digests = session.channel.all_gather_bytes("key-share-commitment", digest)
    moduli = session.engine.moduli_for(share.prime_ids)
    total = session.channel.all_reduce_residues("public-key-shares", share.data, moduli)
    opened = session.channel.all_gather_bytes("public-key-share-open", blob, MAX_KEY_SHARE_BYTES)
    shares = []
    wrong = []
    for rank, (committed, data) in enumerate(zip(digests, opened, strict=True)):
        if key_share_digest(rank, session.channel.world_size, party.session, data) != committed:
            wrong.append(rank)
            continue
        value = value_from_bytes(data, engine=session.engine, expected_type="PublicKeyShare")
        if not isinstance(value, PublicKeyShare) or value.party != rank or value.seed != seed:
            wrong.append(rank)
            continue
        shares.append(value)
    if wrong:
        raise MultipartyError(
            f"rank(s) {wrong} opened a key share that does not match the commitment they published "
            "before any share moved (or one for another rank or seed); the collective key is refused"
        )
    reference = party.combine_public_key(shares, seed)
    if not torch.equal(reference.data[0].cpu(), total.cpu()):
        raise MultipartyError(
            "the summed key shares differ from the sum of the committed, opened shares: a rank (or the "
            "fold) contributed another key share to the sum than it committed to; the collective key is "
            "refused"
        )
    public = party.combine_public_key(total, seed)
    require_agreement(
        session.channel,
        "public-key-fingerprint",
        key_fingerprint(public).encode(),
        lambda wrong: MultipartyError(
            f"rank(s) {wrong} computed another collective public key; the residue exchange is corrupt"
        ),
    )
    session.common_seed = seed
    if session.threshold is not None:
        deal(session, seed)
    else:
        session.challenge_key = agree_challenge_key(session, seed)
    session.public = public
    return public


def _exchange_public_keys(
    session: SessionState,
    identity: dealing.DealingIdentity,
    exchange: str,
    refuse: dealing.Refusal,
    what: str,
) -> list[bytes]:
    """Every rank's X25519 public key (`exchange`: the record exchange's name), checked against the pins
    and refused (`refuse`) when the transport hands this rank back another key than its own.
    """
    channel = session.channel
    keys = channel.all_gather_bytes(exchange, identity.public_bytes, max_bytes=dealing.PUBLIC_KEY_BYTES)
    dealing.check_public_keys(keys, session.dealing_pins)
    if keys[channel.rank] != identity.public_bytes:
        raise refuse(
            f"the transport returned another {what} for rank {channel.rank} than its own", [channel.rank]
        )
    return keys


def agree_challenge_key(session: SessionState, seed: bytes) -> bytes:
    """N-out-of-N: the secret challenge key of the sum checks (fhelium.multiparty.challenge).

    Three record exchanges: the public keys (this rank's dealing key, checked against the pins),
    one seed per rank sealed to every other rank, and the confirmations (every rank must hold every
    other rank's seed and key list as it does; a rank that dealt different seeds is named).
    """
    party, channel = session.party, session.channel
    identity = session.dealing_identity or dealing.DealingIdentity.generate()
    keys = _exchange_public_keys(
        session, identity, "challenge-keys", challenge.ChallengeKeyError, "public key"
    )
    mine = challenge.fresh_seed()
    record = challenge.seal_seed(
        identity, dict.fromkeys(range(channel.world_size), mine), keys, dealer=channel.rank,
        session=party.session, common_seed=seed,
    )
    records = channel.all_gather_bytes("challenge-seeds", record, max_bytes=max(len(record), 1))
    me = dealing.Recipient(identity, channel.rank, keys)
    seeds = [
        mine if dealer == channel.rank else challenge.open_seed(
            me, blob, dealer=dealer, session=party.session, common_seed=seed
        )
        for dealer, blob in enumerate(records)
    ]
    confirmation = challenge.confirmation(party.session, seed, keys, seeds)
    confirmations = channel.all_gather_bytes("challenge-confirm", confirmation, max_bytes=len(confirmation))
    challenge.check_confirmations(channel.rank, confirmations)
    return challenge.challenge_key(party.session, seed, keys, seeds)

def deal(session: SessionState, seed: bytes) -> None:
    """t-out-of-N: deal this rank's Shamir points, sealed to each receiver's dealing key.

    Three record exchanges: the dealing public keys (checked against the pins), the sealed points
    (every dealer's record holds one sealed point per other rank; each rank opens its own), and
    the transcript fingerprint (every rank must have seen the same keys). Afterwards this rank
    holds sk_j = Σ_i f_i(x_j) and no longer its additive share.
    """
    assert session.threshold is not None
    party, channel, t = session.party, session.channel, session.threshold
    identity = session.dealing_identity = session.dealing_identity or dealing.DealingIdentity.generate()
    keys = _exchange_public_keys(session, identity, "dealing-keys", dealing.DealingError, "dealing key")
    points = shamir.deal(party, t)
    if session.dealing_audit is not None:
        for receiver, point in points.items():
            session.dealing_audit(receiver, point)
    record = dealing.seal_points(
        identity, points, keys, dealer=channel.rank, session=party.session, seed=seed, threshold=t
    )
    records = channel.all_gather_bytes("shamir-points", record, max_bytes=max(len(record), 1))
    ids = tuple(range(len(session.engine.moduli)))
    received = {channel.rank: points[channel.rank]}
    me = dealing.Recipient(identity, channel.rank, keys)
    for dealer, blob in enumerate(records):
        if dealer != channel.rank:
            received[dealer] = dealing.open_point(
                me, blob, dealer=dealer, session=party.session, seed=seed, threshold=t,
                moduli=session.engine.moduli_for(ids),
                ring_degree=session.engine.ring_degree,
            ).to(session.engine.device)
    prepare = getattr(channel, "prepare_members", None)
    if prepare is not None:  # before the last exchange: no rank leaves key generation while another
        prepare(session.alive)  # is still connecting the group to it
    fingerprint = dealing.transcript_fingerprint(party.session, seed, t, keys)
    require_agreement(
        channel,
        "dealing-transcript",
        fingerprint,
        lambda differing: dealing.DealingError(
            f"rank(s) {differing} saw other dealing keys than rank {channel.rank}: the transport showed "
            "ranks different keys (a substituted key would let it read the points sealed to it); the "
            "t-out-of-N keys are refused. Pin the dealing keys (docs/security.md, 't-out-of-N keys')",
            differing,
        ),
    )
    session.shamir_share = shamir.receive(party, received)
    party.secret = None  # the additive share is spent: decryption goes through the Shamir share
    session.dealing_fingerprint = fingerprint.hex()


__all__ = [
    "KEY_SHARE_COMMITMENT_DOMAIN",
    "MAX_KEY_SHARE_BYTES",
    "agree_challenge_key",
    "deal",
    "generate_public_key",
    "key_fingerprint",
    "key_share_digest",
]
