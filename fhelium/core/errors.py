"""Errors raised when fhelium values are malformed or combined in incompatible states.

Every error is a ``ValueError`` subclass so callers that only care about "bad input" can catch
one type, while tests and tools can tell the reasons apart.
"""

from __future__ import annotations


class FheliumValueError(ValueError):
    """A value or an operation's operands violate the CKKS value model."""


class ValueStateError(FheliumValueError):
    """A value's metadata (domain, basis, residue form, components) is not what an operation needs."""


class ScaleMismatchError(FheliumValueError):
    """Two operands must carry exactly the same scale and do not."""


class DepthMismatchError(FheliumValueError):
    """Two operands live at different depths (multiplicative levels)."""


class PrimeMismatchError(FheliumValueError):
    """Two operands' limbs are residues modulo different primes."""


class ShapeMismatchError(FheliumValueError):
    """Two operands have different tensor shapes, dtypes or devices."""


class MaximumDepthError(FheliumValueError):
    """The value has no further prime to drop (rescale / mod switch at the last depth)."""


class ParameterMismatchError(FheliumValueError):
    """A value does not fit the engine's parameters (ring degree, primes, dtype)."""


class MissingKeyError(FheliumValueError):
    """An operation needs an evaluation key that has not been generated or supplied."""
