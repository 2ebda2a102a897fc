"""A serialized value whose header declares a zero-element tensor with huge extents is refused
as a value error (issue 13, point 10): torch would raise 'Stride calculation overflowed' while
building it, a RuntimeError that callers handling FheliumValueError do not expect.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import pytest
import torch

from fhelium.core import Ciphertext, FheliumValueError, Plaintext
from fhelium.serialization import inspect_bytes, value_from_bytes, value_to_bytes

HUGE = 2**40 - 1


def _plaintext() -> Plaintext:
    return Plaintext(torch.zeros(2, 8, dtype=torch.float64), 0, 2.0**30)


def _ciphertext() -> Ciphertext:
    return Ciphertext(torch.zeros((2, 3, 16), dtype=torch.int64), 1, 2.0**40, (1, 2, 3))


def _with_shape(blob: bytes, shape: list[int]) -> bytes:
    """The same value header, its one tensor re-declared with ``shape`` and no bytes."""
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    (name,) = [key for key in header if key != "__metadata__"]
    header[name]["shape"] = shape
    header[name]["data_offsets"] = [0, 0]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (_plaintext, [0] + [HUGE] * 7),
        (_plaintext, [0, 2**32, 2**31]),
        (_ciphertext, [2, 0, *([HUGE] * 5), 3, 16]),
    ],
)
def test_zero_element_tensor_with_huge_extents_is_a_value_error(
    make: Callable[[], object], shape: list[int]
) -> None:
    forged = _with_shape(value_to_bytes(make()), shape)
    for read in (value_from_bytes, inspect_bytes):
        with pytest.raises(FheliumValueError, match=r"spans over \d+ elements \(zero extents counted as one"):
            read(forged)
