"""Typed multiparty values: key shares, seed commitments and reveals, decryption shares.

Each registers with ``fhelium.serialization`` (``register_value_type``), so it travels as bytes or a
file like every other fhelium value — no pickle — and its metadata, shapes and residue ranges are
validated before a payload is used. ``SecretKeyShare`` is serialized only with ``allow_secret=True``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fhelium.core import FheliumValueError
from fhelium.core.state import check_depth, check_integer_tensor, coerce_prime_ids, coerce_scale
from fhelium.serialization.value import ValueTypeExtension, register_value_type

SEED_BYTES = 32
DIGEST_BYTES = 32
MAX_PARTIES = 1 << 16
MAX_SESSION_CHARS = 256


def _check_party(owner: str, party: object, parties: object) -> None:
    if type(parties) is not int or not 1 <= parties <= MAX_PARTIES:
        raise FheliumValueError(f"{owner} parties must be an int in [1, {MAX_PARTIES}]; got {parties!r}")
    if type(party) is not int or not 0 <= party < parties:
        raise FheliumValueError(f"{owner} party must be an int in [0, parties={parties}); got {party!r}")


def _check_hex(owner: str, name: str, value: object, nbytes: int) -> None:
    if (
        not isinstance(value, str)
        or len(value) != 2 * nbytes
        or any(c not in "0123456789abcdef" for c in value)
    ):
        raise FheliumValueError(
            f"{owner} {name} must be {2 * nbytes} lowercase hex characters ({nbytes} bytes)"
        )


def _check_session(owner: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_SESSION_CHARS or not value.isprintable():
        raise FheliumValueError(
            f"{owner} session must be a printable string of at most {MAX_SESSION_CHARS} characters"
        )


def _check_prime_ids_meta(owner: str, value: object) -> None:
    if not isinstance(value, (list, tuple)) or not value or any(type(i) is not int or i < 0 for i in value):
        raise FheliumValueError(
            f"{owner} prime_ids must be a non-empty list of non-negative ints; got {value!r}"
        )
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise FheliumValueError(f"{owner} prime_ids must be strictly increasing: {list(value)}")


def _check_data_shape(
    owner: str, tensors: Mapping[str, Mapping[str, Any]], prime_count: int, *, exact_ndim: int | None
) -> None:
    entry = tensors["data"]
    shape = tuple(entry["shape"])
    dtype = str(entry.get("dtype", "")).removeprefix("torch.")
    if dtype != "int64":
        raise FheliumValueError(f"{owner} envelope tensor 'data' must be int64; got {dtype}")
    if len(shape) < 2 or (exact_ndim is not None and len(shape) != exact_ndim):
        want = f"{exact_ndim} dimensions" if exact_ndim is not None else "[*batch, limb, N]"
        raise FheliumValueError(f"{owner} envelope data must have {want}; got {list(shape)}")
    if shape[-2] != prime_count:
        raise FheliumValueError(
            f"{owner} envelope limb axis has {shape[-2]} rows but prime_ids names {prime_count}"
        )


# --------------------------------------------------------------------------- key shares


@dataclass(eq=False)
class _KeyShare:
    """What both key shares hold: party ``party``'s ``data [limb, N]`` over ``prime_ids``, NTT domain."""

    data: torch.Tensor
    prime_ids: tuple[int, ...]
    party: int
    parties: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_integer_tensor(owner, "data", self.data, min_ndim=2)
        self.prime_ids = coerce_prime_ids(owner, self.prime_ids)
        if self.data.ndim != 2 or self.data.size(0) != len(self.prime_ids):
            raise FheliumValueError(
                f"{owner} data must be [limb={len(self.prime_ids)}, N]; got {tuple(self.data.shape)}"
            )
        _check_party(owner, self.party, self.parties)


@dataclass(eq=False)
class SecretKeyShare(_KeyShare):
    """Party ``party``'s ternary secret s_i over every QP prime, NTT domain (``data [limb, N]``)."""

    def __repr__(self) -> str:
        return f"SecretKeyShare(party={self.party}/{self.parties}, prime_ids={list(self.prime_ids)})"


@dataclass(eq=False)
class PublicKeyShare(_KeyShare):
    """p_i = −a·s_i + e_i over every QP prime, NTT domain; ``a`` is expanded from ``seed`` (public)."""

    seed: bytes

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.seed, bytes) or len(self.seed) != SEED_BYTES:
            raise FheliumValueError(f"PublicKeyShare seed must be {SEED_BYTES} bytes")


# --------------------------------------------------------------------------- the common seed


@dataclass(eq=False)
class _SeedRecord:
    """What both seed records hold: party ``party``'s record in ``session``, and one bytes field."""

    party: int
    parties: int
    session: str

    # the subclass's bytes field and its length
    BYTES_FIELD: ClassVar[tuple[str, int]]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_party(owner, self.party, self.parties)
        _check_session(owner, self.session)
        field, nbytes = self.BYTES_FIELD
        value = getattr(self, field)
        if not isinstance(value, bytes) or len(value) != nbytes:
            raise FheliumValueError(f"{owner} {field} must be {nbytes} bytes")


@dataclass(eq=False)
class SeedCommitment(_SeedRecord):
    """SHA-256 commitment of party ``party`` to its 32-byte seed contribution.

    See protocol.commitment_digest.
    """

    BYTES_FIELD = ("digest", DIGEST_BYTES)
    digest: bytes


@dataclass(eq=False)
class SeedReveal(_SeedRecord):
    """The opened contribution of party ``party`` (checked against its commitment)."""

    BYTES_FIELD = ("contribution", SEED_BYTES)
    contribution: bytes


# --------------------------------------------------------------------------- decryption shares


@dataclass(eq=False)
class DecryptionShare:
    """h_i = s_i·c1 + e_i' (flooding noise e_i'), NTT domain, ``data [*batch, limb, N]``.

    ``ciphertext_digest`` is SHA-256 of the c1 it was made for, so a share cannot be combined with
    another ciphertext by mistake; ``depth`` and ``scale`` are the ciphertext's.
    """

    data: torch.Tensor
    prime_ids: tuple[int, ...]
    depth: int
    scale: float
    party: int
    parties: int
    ciphertext_digest: bytes

    def __post_init__(self) -> None:
        owner = "DecryptionShare"
        check_integer_tensor(owner, "data", self.data, min_ndim=2)
        self.prime_ids = coerce_prime_ids(owner, self.prime_ids)
        if self.data.size(-2) != len(self.prime_ids):
            raise FheliumValueError(
                f"{owner} limb axis has {self.data.size(-2)} rows, prime_ids names {len(self.prime_ids)}"
            )
        self.depth = check_depth(owner, self.depth)
        self.scale = coerce_scale(owner, self.scale)
        _check_party(owner, self.party, self.parties)
        if not isinstance(self.ciphertext_digest, bytes) or len(self.ciphertext_digest) != DIGEST_BYTES:
            raise FheliumValueError(f"{owner} ciphertext_digest must be {DIGEST_BYTES} bytes")

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[:-2])


# --------------------------------------------------------------------------- registration


# A ValueTypeExtension's validate: (metadata, tensor descriptions) -> None, raising when invalid.
_Validator = Callable[[Mapping[str, Any], Mapping[str, Mapping[str, Any]] | None], None]


def _validate_key_share(name: str, has_seed: bool) -> _Validator:
    def validate(metadata: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]] | None) -> None:
        _check_prime_ids_meta(name, metadata["prime_ids"])
        _check_party(name, metadata["party"], metadata["parties"])
        if has_seed:
            _check_hex(name, "seed_hex", metadata["seed_hex"], SEED_BYTES)
        if tensors is not None:
            _check_data_shape(name, tensors, len(metadata["prime_ids"]), exact_ndim=2)

    return validate


def _validate_decryption_share(
    metadata: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]] | None
) -> None:
    name = "DecryptionShare"
    _check_prime_ids_meta(name, metadata["prime_ids"])
    _check_party(name, metadata["party"], metadata["parties"])
    check_depth(name, metadata["depth"])
    coerce_scale(name, metadata["scale"])
    _check_hex(name, "ciphertext_digest_hex", metadata["ciphertext_digest_hex"], DIGEST_BYTES)
    if tensors is not None:
        _check_data_shape(name, tensors, len(metadata["prime_ids"]), exact_ndim=None)


def _validate_seed_record(name: str, field: str) -> _Validator:
    def validate(metadata: Mapping[str, Any], tensors: Mapping[str, Mapping[str, Any]] | None) -> None:
        _check_party(name, metadata["party"], metadata["parties"])
        _check_session(name, metadata["session"])
        _check_hex(name, field, metadata[field], 32)

    return validate


def _no_tensors(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    return ()


def _data_only(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    return ("data",)


def _register() -> None:
    register_value_type(
        ValueTypeExtension(
            "SecretKeyShare",
            SecretKeyShare,
            ("prime_ids", "party", "parties"),
            _data_only,
            _validate_key_share("SecretKeyShare", False),
            lambda v: (
                {"prime_ids": list(v.prime_ids), "party": v.party, "parties": v.parties},
                {"data": v.data},
            ),
            lambda m, t: SecretKeyShare(t["data"], tuple(m["prime_ids"]), m["party"], m["parties"]),
            secret=True,
        )
    )
    register_value_type(
        ValueTypeExtension(
            "PublicKeyShare",
            PublicKeyShare,
            ("prime_ids", "party", "parties", "seed_hex"),
            _data_only,
            _validate_key_share("PublicKeyShare", True),
            lambda v: (
                {
                    "prime_ids": list(v.prime_ids),
                    "party": v.party,
                    "parties": v.parties,
                    "seed_hex": v.seed.hex(),
                },
                {"data": v.data},
            ),
            lambda m, t: PublicKeyShare(
                t["data"], tuple(m["prime_ids"]), m["party"], m["parties"], bytes.fromhex(m["seed_hex"])
            ),
        )
    )
    register_value_type(
        ValueTypeExtension(
            "SeedCommitment",
            SeedCommitment,
            ("party", "parties", "session", "digest_hex"),
            _no_tensors,
            _validate_seed_record("SeedCommitment", "digest_hex"),
            lambda v: (
                {"party": v.party, "parties": v.parties, "session": v.session, "digest_hex": v.digest.hex()},
                {},
            ),
            lambda m, t: SeedCommitment(
                m["party"], m["parties"], m["session"], bytes.fromhex(m["digest_hex"])
            ),
        )
    )
    register_value_type(
        ValueTypeExtension(
            "SeedReveal",
            SeedReveal,
            ("party", "parties", "session", "contribution_hex"),
            _no_tensors,
            _validate_seed_record("SeedReveal", "contribution_hex"),
            lambda v: (
                {
                    "party": v.party,
                    "parties": v.parties,
                    "session": v.session,
                    "contribution_hex": v.contribution.hex(),
                },
                {},
            ),
            lambda m, t: SeedReveal(
                m["party"], m["parties"], m["session"], bytes.fromhex(m["contribution_hex"])
            ),
        )
    )
    register_value_type(
        ValueTypeExtension(
            "DecryptionShare",
            DecryptionShare,
            ("prime_ids", "depth", "scale", "party", "parties", "ciphertext_digest_hex"),
            _data_only,
            _validate_decryption_share,
            lambda v: (
                {
                    "prime_ids": list(v.prime_ids),
                    "depth": v.depth,
                    "scale": v.scale,
                    "party": v.party,
                    "parties": v.parties,
                    "ciphertext_digest_hex": v.ciphertext_digest.hex(),
                },
                {"data": v.data},
            ),
            lambda m, t: DecryptionShare(
                t["data"],
                tuple(m["prime_ids"]),
                m["depth"],
                m["scale"],
                m["party"],
                m["parties"],
                bytes.fromhex(m["ciphertext_digest_hex"]),
            ),
        )
    )


_register()

__all__ = ["DecryptionShare", "PublicKeyShare", "SecretKeyShare", "SeedCommitment", "SeedReveal"]
