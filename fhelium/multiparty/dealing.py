"""Confidential dealing of Shamir points between ranks (t-out-of-N keys across processes), sans-io.

Party i's point f_i(x_j) (``fhelium.multiparty.shamir.deal``) is a secret for party j alone. It
travels through the run's transport (the rendezvous store, the relays, the controller), so it is
sealed to a key j controls:

- every party has an X25519 *dealing key* (fresh per session, or a long-term one loaded from a file
  the operator keeps; ``DealingIdentity``) and publishes its 32-byte public key first;
- dealer i and receiver j agree on X25519(sk_i, pk_j); HKDF-SHA256 over it, bound to the direction
  (i → j), derives a ChaCha20-Poly1305 key; the point is sealed under a random 96-bit nonce with the
  associated data ``dealing_aad``: a domain label, the session, the common seed of this key
  generation (so a dealing is never valid for another one), the world size, the threshold, the
  dealer, the receiver and both public keys;
- the receiver opens only the points addressed to it; a point altered, replayed from another
  session or key generation, or re-addressed fails authentication and is refused, naming the dealer.

What authenticates j's public key is the transport, unless the operator pins it: an active
aggregator (the controller on the relay road, whoever runs the rendezvous store on the process
group) could hand dealer i its own key in place of j's and read i's point for j. Every rank then
all-gathers the fingerprint of the key list it saw (``transcript_fingerprint``), which catches a
substitution shown to some ranks only, and prints it; ``pins`` (rank → SHA-256 hex of the rank's
public key, from an operator-kept file) refuses any other key. docs/security.md, "t-out-of-N keys".
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fhelium.multiparty.protocol import MultipartyError

DEALING_DOMAIN = b"fhelium.multiparty.shamir-dealing.v1"
TRANSCRIPT_DOMAIN = b"fhelium.multiparty.dealing-transcript.v1"
PUBLIC_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_IDENTITY_FILE_BYTES = 4096


class DealingError(MultipartyError):
    """A Shamir point or a dealing key was refused (forged, re-addressed, replayed, or not pinned)."""

    def __init__(self, message: str, parties: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.parties = sorted(parties)


@dataclass(frozen=True)
class DealingIdentity:
    """A party's X25519 dealing key. ``generate()`` for a fresh one per session; ``load(path)`` for an
    operator-kept long-term one (32 raw bytes, or 64 hex characters), whose public key can be pinned.
    """

    private: X25519PrivateKey

    @classmethod
    def generate(cls) -> DealingIdentity:
        return cls(X25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DealingIdentity:
        file = Path(path)
        size = file.stat().st_size
        if size > MAX_IDENTITY_FILE_BYTES:
            raise DealingError(f"dealing key file {file} is {size} bytes; expected 32 raw bytes or 64 hex")
        raw = file.read_bytes()
        text = raw.strip()
        if len(text) == 2 * PUBLIC_KEY_BYTES and all(c in b"0123456789abcdefABCDEF" for c in text):
            raw = bytes.fromhex(text.decode())
        if len(raw) != PUBLIC_KEY_BYTES:
            raise DealingError(
                f"dealing key file {file} holds {len(raw)} bytes; expected a 32-byte X25519 private key "
                "(raw, or as 64 hex characters). Make one with: python -m fhelium.multiparty.dealing new FILE"
            )
        return cls(X25519PrivateKey.from_private_bytes(raw))

    @property
    def public_bytes(self) -> bytes:
        return self.private.public_key().public_bytes_raw()

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_bytes)


def key_fingerprint(public: bytes) -> str:
    """SHA-256 hex of a raw X25519 public key: what an operator pins."""
    return hashlib.sha256(public).hexdigest()


def check_public_keys(keys: Sequence[bytes], pins: Mapping[int, str] | None = None) -> None:
    """Refuse malformed keys, a key used by two ranks, and any key that differs from its rank's pin."""
    wrong = [rank for rank, key in enumerate(keys) if len(key) != PUBLIC_KEY_BYTES]
    if wrong:
        raise DealingError(
            f"rank(s) {wrong} published a dealing key that is not {PUBLIC_KEY_BYTES} bytes; the dealing "
            "is refused",
            wrong,
        )
    seen: dict[bytes, int] = {}
    for rank, key in enumerate(keys):
        if key in seen:
            raise DealingError(
                f"ranks {seen[key]} and {rank} published the same dealing key: one of them (or the "
                "transport) substituted it, and points for one would be readable by the other; refused",
                [seen[key], rank],
            )
        seen[key] = rank
    if pins:
        unpinned = [
            rank for rank, pin in sorted(pins.items())
            if rank >= len(keys) or key_fingerprint(keys[rank]) != pin.lower()
        ]
        if unpinned:
            raise DealingError(
                f"rank(s) {unpinned} published a dealing key whose SHA-256 is not the pinned one: the "
                "transport (the controller or the rendezvous store) or the rank substituted it; no Shamir "
                "point is sealed to it. Check the pin file against each rank's dealing key fingerprint",
                unpinned,
            )


def transcript_fingerprint(session: str, seed: bytes, threshold: int, keys: Sequence[bytes]) -> bytes:
    """SHA-256 over the session, the common seed, the threshold and every rank's dealing key in rank order."""
    header = f"{len(session)}:{session}/{len(keys)}/{threshold}".encode()
    digest = hashlib.sha256(TRANSCRIPT_DOMAIN + len(header).to_bytes(4, "big") + header + seed)
    for key in keys:
        digest.update(key)
    return digest.digest()


def dealing_aad(
    session: str, seed: bytes, parties: int, threshold: int, dealer: int, receiver: int,
    dealer_key: bytes, receiver_key: bytes,
) -> bytes:
    header = f"{len(session)}:{session}/{parties}/{threshold}/{dealer}->{receiver}".encode()
    return DEALING_DOMAIN + len(header).to_bytes(4, "big") + header + seed + dealer_key + receiver_key


def _aead(
    private: X25519PrivateKey, other: bytes, dealer: int, receiver: int, domain: bytes
) -> ChaCha20Poly1305:
    shared = private.exchange(X25519PublicKey.from_public_bytes(other))
    key = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None,
        info=domain + f"/key/{dealer}->{receiver}".encode(),
    ).derive(shared)
    return ChaCha20Poly1305(key)


Refusal = Callable[[str, list[int]], Exception]
"""How a protocol of sealed records refuses: its own error type, from a message and the ranks at fault."""


def seal_to_each(
    identity: DealingIdentity,
    keys: Sequence[bytes],
    dealer: int,
    payload: Callable[[int], bytes],
    aad: Callable[[int], bytes],
    domain: bytes,
    refuse: Refusal,
) -> bytes:
    """Dealer ``dealer``'s record: for every other rank in rank order, nonce ‖ ``payload(receiver)`` sealed
    to that rank (ChaCha20-Poly1305 under HKDF-SHA256 of the pairwise X25519 secret, direction dealer →
    receiver, ``domain`` naming the protocol; ``aad(receiver)`` bound in). The dealing of Shamir points
    and the sum checks' challenge seeds (fhelium.multiparty.challenge) are both such records. Refused
    (``refuse``) when this rank's own public key was replaced in ``keys``.
    """
    if keys[dealer] != identity.public_bytes:
        raise refuse(f"rank {dealer}'s own public key was replaced in the key list", [dealer])
    out = bytearray()
    for receiver in range(len(keys)):
        if receiver == dealer:
            continue
        nonce = os.urandom(NONCE_BYTES)
        sealer = _aead(identity.private, keys[receiver], dealer, receiver, domain)
        out += nonce + sealer.encrypt(nonce, payload(receiver), aad(receiver))
    return bytes(out)


@dataclass(frozen=True)
class Recipient:
    """This rank as the receiver of sealed records: its dealing identity, its rank, and every rank's public
    key in rank order (the list the records were sealed under).
    """

    identity: DealingIdentity
    rank: int
    keys: Sequence[bytes]


def open_from(
    recipient: Recipient,
    record: bytes,
    *,
    dealer: int,
    entry_bytes: int,
    aad: bytes,
    domain: bytes,
    refuse: Refusal,
    what: str,
    forged: str,
) -> bytes:
    """What ``dealer``'s record (``seal_to_each``) sealed for ``recipient``, authenticated. Refused
    (``refuse``, naming the dealer) unless the record is ``len(keys) - 1`` entries of ``entry_bytes``
    (``what``: the entries' name, plural), and with the message ``forged`` when the entry fails
    authentication.
    """
    keys, receiver = recipient.keys, recipient.rank
    entries = len(keys) - 1
    if len(record) != entry_bytes * entries:
        raise refuse(
            f"rank {dealer}'s record is {len(record)} bytes; expected {entry_bytes * entries} "
            f"({entries} {what} of {entry_bytes})",
            [dealer],
        )
    slot = receiver if receiver < dealer else receiver - 1
    entry = record[slot * entry_bytes : (slot + 1) * entry_bytes]
    opener = _aead(recipient.identity.private, keys[dealer], dealer, receiver, domain)
    try:
        return opener.decrypt(entry[:NONCE_BYTES], entry[NONCE_BYTES:], aad)
    except InvalidTag:
        raise refuse(forged, [dealer]) from None


def point_bytes(limbs: int, ring_degree: int) -> int:
    return limbs * ring_degree * 8


def sealed_bytes(limbs: int, ring_degree: int) -> int:
    return NONCE_BYTES + point_bytes(limbs, ring_degree) + TAG_BYTES


def seal_points(
    identity: DealingIdentity,
    points: Mapping[int, torch.Tensor],
    keys: Sequence[bytes],
    *,
    dealer: int,
    session: str,
    seed: bytes,
    threshold: int,
) -> bytes:
    """Dealer ``dealer``'s record: for every other receiver in rank order, nonce ‖ sealed point."""
    parties = len(keys)
    return seal_to_each(
        identity,
        keys,
        dealer,
        lambda receiver: points[receiver].contiguous().cpu().numpy().tobytes(),
        lambda receiver: dealing_aad(
            session, seed, parties, threshold, dealer, receiver, keys[dealer], keys[receiver]
        ),
        DEALING_DOMAIN,
        DealingError,
    )


def open_point(
    recipient: Recipient,
    record: bytes,
    *,
    dealer: int,
    session: str,
    seed: bytes,
    threshold: int,
    moduli: Sequence[int],
    ring_degree: int,
) -> torch.Tensor:
    """The point dealer ``dealer`` sealed for ``recipient`` (this party), checked: authenticated, in range."""
    keys, receiver = recipient.keys, recipient.rank
    aad = dealing_aad(session, seed, len(keys), threshold, dealer, receiver, keys[dealer], keys[receiver])
    plain = open_from(
        recipient, record, dealer=dealer, entry_bytes=sealed_bytes(len(moduli), ring_degree), aad=aad,
        domain=DEALING_DOMAIN, refuse=DealingError, what="sealed points",
        forged=f"the Shamir point rank {dealer} dealt to rank {receiver} fails authentication: it was "
        "altered, re-addressed, or sealed for another session, key generation or dealing key; refused",
    )
    point = torch.frombuffer(bytearray(plain), dtype=torch.int64).view(len(moduli), ring_degree)
    q = torch.tensor(list(moduli), dtype=torch.int64).unsqueeze(-1)
    if bool(((point < 0) | (point >= q)).any()):
        raise DealingError(
            f"rank {dealer}'s Shamir point for rank {receiver} has residues out of range", [dealer]
        )
    return point


def _main(argv: Sequence[str]) -> int:
    """``python -m fhelium.multiparty.dealing new FILE``: a long-term dealing key (mode 0600) and its pin."""
    if len(argv) != 2 or argv[0] != "new":
        print("usage: python -m fhelium.multiparty.dealing new FILE")
        return 2
    identity = DealingIdentity.generate()
    from cryptography.hazmat.primitives import serialization

    raw = identity.private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    descriptor = os.open(argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(raw.hex() + "\n")
    print(identity.fingerprint)
    return 0


__all__ = [
    "DEALING_DOMAIN",
    "DealingError",
    "DealingIdentity",
    "Recipient",
    "check_public_keys",
    "dealing_aad",
    "key_fingerprint",
    "open_point",
    "point_bytes",
    "seal_points",
    "sealed_bytes",
    "transcript_fingerprint",
]

if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
