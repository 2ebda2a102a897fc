"""The tensor-leaf schema of every fhelium value, shared by files, bytes and distributed transfer.

A ``ValueEnvelope`` splits a value into JSON-safe metadata and named tensors.
``validate_value_description`` checks the metadata and tensor names **without any tensor**, so a
receiver can refuse a bad description before reading or allocating a payload. Every value type,
core (``core_codecs``) or extension (``fhelium.multiparty``), is one ``ValueCodec`` in the registry
(``registry``): describing, validating and rebuilding look the type up there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fhelium.core import (
    AnyKey,
    Ciphertext,
    CompressedPlaintext,
    FheliumValueError,
    Plaintext,
    SeededCiphertext,
)
from fhelium.serialization.core_codecs import CORE_CODECS, KEY_CODEC_NAMES
from fhelium.serialization.registry import (
    ValueCodec,
    ValueTypeExtension,
    check_metadata_fields,
    check_tensor_shapes,
    codec_of,
    fail,
    is_secret_value,
    register_value_type,
    value_codec,
    value_type_extension,
)

# 2: keys and seeded ciphertexts come from the domain-separated keystream (expansion version 2,
# fhelium/engine/sampling.py). Version 1 keys leaked their secret through the public key's
# uniform part, and version 1 seeds expand to a different c1, so version 1 is refused.
VALUE_SCHEMA_VERSION = 2
_COMPROMISED_SCHEMA_VERSIONS = frozenset({1})

FheliumValue = Ciphertext | Plaintext | CompressedPlaintext | AnyKey | SeededCiphertext

# The core types (extensions are found through value_type_extension / value_codec).
VALUE_TYPES: dict[str, type] = {codec.name: codec.cls for codec in CORE_CODECS}
KEY_VALUE_TYPES = KEY_CODEC_NAMES
METADATA_FIELDS: dict[str, tuple[str, ...]] = {codec.name: codec.metadata_fields for codec in CORE_CODECS}


def expected_tensor_names(value_type: str, metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """Tensor names in payload order for a (validated) description."""
    codec = value_codec(value_type)
    return codec.tensor_names(metadata) if codec is not None else ("data",)


def _check_schema_version(schema_version: object) -> None:
    if type(schema_version) is int and schema_version in _COMPROMISED_SCHEMA_VERSIONS:
        raise FheliumValueError(
            f"Unsupported value envelope schema version: {schema_version} (this fhelium reads version "
            f"{VALUE_SCHEMA_VERSION}). Version {schema_version} values were made with the overlapping "
            "ChaCha20 keystream of fhelium before issue 13: its keys must be treated as compromised "
            "(the public key reveals most of the secret key) and its seeded ciphertexts expand to a "
            "different c1. Generate new keys and re-encrypt; see docs/security.md"
        )
    if type(schema_version) is not int or schema_version != VALUE_SCHEMA_VERSION:
        raise FheliumValueError(
            f"Unsupported value envelope schema version: {schema_version!r} (this fhelium reads "
            f"version {VALUE_SCHEMA_VERSION})"
        )


def validate_value_description(
    *,
    schema_version: object,
    value_type: object,
    metadata: object,
    tensor_names: Sequence[str],
    tensor_metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Validate a value description without touching tensors; raise ``FheliumValueError`` if bad.

    ``tensor_metadata`` (optional) maps tensor name → ``{"shape": tuple, "dtype": torch.dtype|str}``;
    when given, the limb axis extent is checked against ``prime_ids`` as well.
    """
    _check_schema_version(schema_version)
    codec = value_codec(value_type)
    if codec is None:
        raise FheliumValueError(
            f"Unsupported value envelope value_type: {value_type!r}; expected one of {sorted(VALUE_TYPES)}"
        )
    checked = check_metadata_fields(codec, metadata)
    codec.validate(checked, None)
    wanted = list(codec.tensor_names(checked))
    if list(tensor_names) != wanted:
        raise fail(
            codec.name,
            f"tensor names do not match its metadata: expected={wanted}, actual={list(tensor_names)}",
        )
    if tensor_metadata is not None:
        check_tensor_shapes(codec.name, wanted, tensor_metadata)
        codec.validate(checked, tensor_metadata)


@dataclass(frozen=True)
class ValueEnvelope:
    """A value as (schema version, exact type name, JSON-safe metadata, named tensors)."""

    schema_version: int
    value_type: str
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_value(cls, value: object) -> ValueEnvelope:
        """Describe ``value`` (exact types only; subclasses are refused). Tensors are not copied."""
        codec = codec_of(value)
        if codec is None:
            raise FheliumValueError(
                f"Value envelopes support exact fhelium values {sorted(VALUE_TYPES)}; got "
                f"{type(value).__qualname__}"
            )
        metadata, tensors = codec.describe(value)
        return cls(VALUE_SCHEMA_VERSION, codec.name, metadata, tensors)

    def validate(self) -> None:
        validate_value_description(
            schema_version=self.schema_version,
            value_type=self.value_type,
            metadata=self.metadata,
            tensor_names=list(self.tensors),
            tensor_metadata={n: {"shape": tuple(t.shape), "dtype": t.dtype} for n, t in self.tensors.items()},
        )

    def to_value(self) -> FheliumValue:
        """Rebuild the value around the envelope's tensors (aliased, not copied)."""
        self.validate()
        codec = value_codec(self.value_type)
        assert codec is not None  # validate() refuses an unknown value_type
        built: FheliumValue = codec.build(self.metadata, self.tensors)
        return built

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


__all__ = [
    "KEY_VALUE_TYPES",
    "METADATA_FIELDS",
    "VALUE_SCHEMA_VERSION",
    "VALUE_TYPES",
    "FheliumValue",
    "ValueCodec",
    "ValueEnvelope",
    "ValueTypeExtension",
    "expected_tensor_names",
    "is_secret_value",
    "register_value_type",
    "validate_value_description",
    "value_codec",
    "value_type_extension",
]
