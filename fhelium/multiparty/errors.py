"""The errors of fhelium.multiparty: every step that cannot go on raises a ``MultipartyError``.

Their own module so that every part of the protocol can raise them without importing the rest;
fhelium.multiparty.protocol (and the package) re-export them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fhelium.core import FheliumValueError


class MultipartyError(FheliumValueError):
    """A multiparty protocol step cannot go on; the message names the party and the fix."""


class SeedCommitmentError(MultipartyError):
    """A party revealed a seed contribution that does not open its commitment (or none at all)."""


class MissingSharesError(MultipartyError):
    """Decryption (or key generation) lacks some parties' shares: N-out-of-N needs every one."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = sorted(missing)


class FloodingBudgetError(MultipartyError):
    """A party has published as many decryption shares under its key share as its flooding budget allows."""


__all__ = ["FloodingBudgetError", "MissingSharesError", "MultipartyError", "SeedCommitmentError"]
