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
    ValueEnvelope,
    expected_tensor_names,
    validate_value_description,
)

__all__ = [
    "FILE_FORMAT",
    "FILE_SCHEMA_VERSION",
    "KEY_VALUE_TYPES",
    "METADATA_FIELDS",
    "VALUE_SCHEMA_VERSION",
    "VALUE_TYPES",
    "FheliumValue",
    "ValueEnvelope",
    "check_against_engine",
    "expected_tensor_names",
    "inspect_bytes",
    "inspect_value",
    "load_value",
    "save_value",
    "validate_value_description",
    "value_from_bytes",
    "value_to_bytes",
]
