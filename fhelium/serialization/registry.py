"""The value-codec registry: one entry per value type, core and extension alike.

A ``ValueCodec`` says everything envelopes, bytes, files and distributed transfer need about one
value type: its wire name, its exact class, its metadata fields, its tensor names, how to validate a
description (without any payload), how to describe a value and how to rebuild it, and whether it is
secret. ``fhelium.serialization.core_codecs`` registers the ``fhelium.core`` types;
``fhelium.multiparty.values`` registers its shares through ``register_value_type``. Describing,
validating and rebuilding are lookups in this registry, never a switch over types.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fhelium.core import FheliumValueError

# (metadata, tensor descriptions or None) -> None, raising FheliumValueError when invalid.
Validator = Callable[[Mapping[str, Any], Mapping[str, Mapping[str, Any]] | None], None]


@dataclass(frozen=True)
class ValueCodec:
    """How one value type is described, validated and rebuilt.

    ``validate(metadata, tensor_metadata)`` checks the metadata (every field present, none extra,
    is checked by the registry first) and, when given, the tensors' dtypes and shapes (names,
    non-negative extents and the span bound are checked by the registry first), without any
    payload; it raises ``FheliumValueError``. ``describe(value)`` gives (metadata, tensors) and
    ``build(metadata, tensors)`` rebuilds the value. ``secret`` values are serialized only with
    ``allow_secret=True``.
    """

    name: str
    cls: type
    metadata_fields: tuple[str, ...]
    tensor_names: Callable[[Mapping[str, Any]], tuple[str, ...]]
    validate: Validator
    describe: Callable[[Any], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    build: Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]], Any]
    secret: bool = False


# The name extensions (fhelium.multiparty) have always used; one class with ValueCodec.
ValueTypeExtension = ValueCodec

_CODECS: dict[str, ValueCodec] = {}
_CORE_NAMES: set[str] = set()


def register_core_value_type(codec: ValueCodec) -> None:
    """Register a ``fhelium.core`` type (``core_codecs`` only); its name is then reserved."""
    if codec.name in _CODECS:
        raise FheliumValueError(f"value type {codec.name!r} is already registered")
    _CODECS[codec.name] = codec
    _CORE_NAMES.add(codec.name)


def register_value_type(extension: ValueCodec) -> None:
    """Make an extension value type known to envelopes, bytes and files (idempotent per class)."""
    known = _CODECS.get(extension.name)
    if extension.name in _CORE_NAMES or (known is not None and known.cls is not extension.cls):
        raise FheliumValueError(f"value type {extension.name!r} is already registered")
    _CODECS[extension.name] = extension


def value_codec(name: object) -> ValueCodec | None:
    """The registered codec (core or extension) of that name, else None."""
    if not isinstance(name, str):
        return None
    return _CODECS.get(name)


def value_type_extension(name: object) -> ValueCodec | None:
    """The registered extension (not a core type) of that name, else None."""
    codec = value_codec(name)
    return None if codec is None or codec.name in _CORE_NAMES else codec


def codec_of(value: object) -> ValueCodec | None:
    """The codec whose class is exactly ``type(value)``, else None (subclasses have none)."""
    codec = _CODECS.get(type(value).__name__)
    return codec if codec is not None and codec.cls is type(value) else None


def is_secret_value(value: object) -> bool:
    """Whether ``value`` is (an instance of) a secret type: serialized only with allow_secret."""
    return any(codec.secret and isinstance(value, codec.cls) for codec in _CODECS.values())


# --------------------------------------------------------------------------- checks shared by codecs


def fail(value_type: str, message: str) -> FheliumValueError:
    return FheliumValueError(f"{value_type} envelope {message}")


def check_int(value_type: str, name: str, value: object, *, minimum: int = 0) -> None:
    if type(value) is not int or value < minimum:
        raise fail(value_type, f"{name} must be an int >= {minimum}; got {value!r}")


def check_enum(
    value_type: str, name: str, value: object, choices: tuple[str, ...], *, optional: bool
) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in choices:
        raise fail(value_type, f"{name} must be one of {list(choices)}; got {value!r}")


def check_scale(value_type: str, value: object) -> None:
    if type(value) not in (int, float) or not math.isfinite(float(value)) or float(value) <= 0:  # type: ignore[arg-type]  # checked just before
        raise fail(value_type, f"scale must be a positive finite float; got {value!r}")


def check_prime_ids(value_type: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, (list, tuple)):
        raise fail(value_type, f"prime_ids must be a list of ints; got {value!r}")
    if not value and not allow_empty:
        raise fail(value_type, "prime_ids must not be empty")
    if any(type(item) is not int or item < 0 for item in value):
        raise fail(value_type, f"prime_ids must be non-negative ints; got {list(value)}")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise fail(value_type, f"prime_ids must be strictly increasing: {list(value)}")


# Bound on a tensor's extent product with zero extents counted as one: torch computes contiguous
# strides from every extent, so a zero-element shape such as [0] + [2**40 - 1] * 7 holds no bytes
# yet overflows them (a RuntimeError deep in torch instead of a value error). 2**44 elements of
# at most 16 bytes stay far below int64 and far above any real value.
MAX_SHAPE_SPAN_ELEMENTS = 2**44


def check_span(value_type: str, name: str, shape: Sequence[int]) -> None:
    span = 1
    for extent in shape:
        span *= max(extent, 1)
        if span > MAX_SHAPE_SPAN_ELEMENTS:
            raise fail(
                value_type,
                f"tensor {name!r} shape {list(shape)} spans over {MAX_SHAPE_SPAN_ELEMENTS} elements "
                "(zero extents counted as one, as torch's strides count them)",
            )


def check_metadata_fields(codec: ValueCodec, metadata: object) -> Mapping[str, Any]:
    """The metadata as a mapping with exactly the codec's fields, else ``FheliumValueError``."""
    if not isinstance(metadata, Mapping):
        raise fail(codec.name, f"metadata must be a mapping; got {type(metadata).__name__}")
    expected, actual = set(codec.metadata_fields), set(metadata)
    if expected - actual:
        raise fail(codec.name, f"metadata is missing fields: {sorted(expected - actual)}")
    if actual - expected:
        raise fail(codec.name, f"metadata has unexpected fields: {sorted(actual - expected)}")
    return metadata


def check_tensor_shapes(
    value_type: str, names: Sequence[str], tensor_metadata: Mapping[str, Mapping[str, Any]]
) -> None:
    """Tensor descriptions name exactly ``names``, each shape non-negative ints within the span bound."""
    if sorted(tensor_metadata) != sorted(names):
        raise fail(value_type, f"tensor metadata names {sorted(tensor_metadata)} differ from {sorted(names)}")
    for name in names:
        shape = tensor_metadata[name].get("shape")
        if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
            raise fail(
                value_type, f"tensor {name!r} shape must be a sequence of non-negative ints; got {shape!r}"
            )
        check_span(value_type, name, shape)
