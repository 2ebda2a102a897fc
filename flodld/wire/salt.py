"""Session salts: 16 random bytes per run, the input key from which every connection's AEAD keys are derived.

A configured `join.token` is a salt written as 32 hex characters. Every text form of a salt is read by
`salt_from_hex`, and every model that carries one declares it `SaltHex`: the join token of the config, the
wire's Accept, the agent's and the relay's role specs (which carry the host key in the same form). Only a
rank checks the salt its agent put in its environment on its own (`flodld.rank.env`, which loads nothing
of flodld: a rank starts without pydantic).
"""

from __future__ import annotations

import secrets
import string
from typing import Annotated

from pydantic import AfterValidator, StringConstraints

SALT_BYTES = 16
SALT_HEX_CHARS = SALT_BYTES * 2

# Pre-admission frames under open admission are keyed with this public value: they are
# authenticated against nothing, only checked for integrity. The real salt comes in Accept.
OPEN_ADMISSION_KEY = bytes(SALT_BYTES)

_HEX_DIGITS = frozenset(string.hexdigits)


class SaltError(ValueError):
    """A salt or token is malformed; the message says what is wrong and how to fix it."""


def new_salt() -> bytes:
    """A fresh salt from the operating system's CSPRNG."""
    return secrets.token_bytes(SALT_BYTES)


def salt_to_hex(salt: bytes) -> str:
    if len(salt) != SALT_BYTES:
        raise SaltError(f"session salt must be {SALT_BYTES} bytes, got {len(salt)}")
    return salt.hex()


def salt_from_hex(text: str) -> bytes:
    """Parse a 32-hex-character token (either case, surrounding whitespace ignored)."""
    cleaned = text.strip()
    if len(cleaned) != SALT_HEX_CHARS:
        raise SaltError(
            f"session token must be {SALT_HEX_CHARS} hex characters ({SALT_BYTES} bytes), got "
            f"{len(cleaned)}; generate one with: python -c 'import secrets; print(secrets.token_hex(16))'"
        )
    for position, char in enumerate(cleaned):
        if char not in _HEX_DIGITS:
            raise SaltError(
                f"session token has a non-hex character {char!r} at position {position}; "
                "only 0-9 and a-f are allowed"
            )
    return bytes.fromhex(cleaned)


def _normalised(text: str) -> str:
    return salt_to_hex(salt_from_hex(text))


SaltHex = Annotated[str, StringConstraints(max_length=64), AfterValidator(_normalised)]
"""A session salt (or a key of the same 16 bytes) as 32 hex characters, either case in, lowercase out; a
malformed one is refused with `salt_from_hex`'s message (what is wrong, and how to make one)."""
