"""The refusals of the encrypted aggregation: each names what differed and how to fix it."""

from __future__ import annotations

__all__ = [
    "AggregationError",
    "KeyMismatchError",
    "MissingSharesAggregationError",
    "ParameterMismatchError",
    "WorldChangedError",
]


class AggregationError(RuntimeError):
    """The encrypted aggregation cannot go on; the message says what differed and how to fix it."""


class ParameterMismatchError(AggregationError):
    """Ranks disagree on CKKS parameters or workload shape (found by the descriptor handshake)."""


class KeyMismatchError(AggregationError):
    """A rank encrypts under a public key other than the key holder's."""


class WorldChangedError(AggregationError):
    """A rank left (or the membership changed) while the aggregation was in flight."""


class MissingSharesAggregationError(AggregationError):
    """A rank's key share or decryption share never arrived: N-out-of-N decryption is impossible."""
