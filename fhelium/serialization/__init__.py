"""Versioned value envelopes and their file/bytes codecs."""

from __future__ import annotations

from fhelium.serialization.codec import (
    FILE_FORMAT,
    FILE_SCHEMA_VERSION,
    check_against_engine,
    inspect_bytes,
    inspect_value,
    load_value,
    save_value,
    value_from_bytes,
    value_to_bytes,
)
from fhelium.serialization.value import (
    KEY_VALUE_TYPES,
    METADATA_FIELDS,
    VALUE_SCHEMA_VERSION,
    VALUE_TYPES,
    FheliumValue,
    ValueCodec,
    ValueEnvelope,
    ValueTypeExtension,
    expected_tensor_names,
    is_secret_value,
    register_value_type,
    validate_value_description,
    value_codec,
    value_type_extension,
)

__all__ = [
    "FILE_FORMAT",
    "FILE_SCHEMA_VERSION",
    "KEY_VALUE_TYPES",
    "METADATA_FIELDS",
    "VALUE_SCHEMA_VERSION",
    "VALUE_TYPES",
    "FheliumValue",
    "ValueCodec",
    "ValueEnvelope",
    "ValueTypeExtension",
    "check_against_engine",
    "expected_tensor_names",
    "inspect_bytes",
    "inspect_value",
    "is_secret_value",
    "load_value",
    "register_value_type",
    "save_value",
    "validate_value_description",
    "value_codec",
    "value_from_bytes",
    "value_to_bytes",
    "value_type_extension",
]
