"""Values as safetensors files or in-memory bytes, validated before any payload is read.

Layout: a standard safetensors blob whose string metadata holds ``fhelium.format``,
``fhelium.schema_version`` and ``fhelium.manifest`` (JSON: value type, value schema version,
value metadata, the actual prime moduli of the value's limbs, tensor shapes/dtypes). Loading
parses and validates the header first (sizes capped before allocation), then the tensors, and,
given an engine, checks ring degree, primes and residue ranges against its parameters.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import safetensors.torch
import torch

from fhelium.core import FheliumValueError, ParameterMismatchError
from fhelium.serialization.value import (
    FheliumValue,
    ValueEnvelope,
    is_secret_value,
    validate_value_description,
)

FILE_FORMAT = "fhelium-value"
FILE_SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 1 << 20

_DTYPES = {"I64": torch.int64, "I32": torch.int32, "F64": torch.float64, "F32": torch.float32}


class EngineLike(Protocol):
    ring_degree: int

    def moduli_for(self, prime_ids: Iterable[int]) -> list[int]: ...


def _manifest(envelope: ValueEnvelope, engine: EngineLike | None) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "file_schema_version": FILE_SCHEMA_VERSION,
        "value_schema_version": envelope.schema_version,
        "value_type": envelope.value_type,
        "value_metadata": envelope.metadata,
        "tensor_names": list(envelope.tensors),
    }
    prime_ids = envelope.metadata.get("prime_ids") or []
    if engine is not None and prime_ids:
        manifest["moduli"] = [str(q) for q in engine.moduli_for(prime_ids)]
    return manifest


def value_to_bytes(value: object, *, engine: EngineLike | None = None, allow_secret: bool = False) -> bytes:
    """Serialize a value; ``engine`` (optional) records the prime values for later checks."""
    if is_secret_value(value) and not allow_secret:
        raise PermissionError(f"refusing to serialize a {type(value).__name__} without allow_secret=True")
    envelope = ValueEnvelope.from_value(value)
    tensors = {}
    complex_names = []
    for name, tensor in envelope.tensors.items():
        # safetensors has no complex dtypes: store (real, imag) pairs and say so in the manifest
        if tensor.is_complex():
            complex_names.append(name)
            tensor = torch.view_as_real(tensor)
        tensors[name] = tensor.detach().cpu().contiguous()
    manifest = _manifest(envelope, engine)
    manifest["complex_tensors"] = complex_names
    metadata = {
        "fhelium.format": FILE_FORMAT,
        "fhelium.schema_version": str(FILE_SCHEMA_VERSION),
        "fhelium.manifest": json.dumps(manifest, sort_keys=True),
    }
    return bytes(safetensors.torch.save(tensors, metadata=metadata))


def _read_header(blob: bytes | memoryview) -> dict[str, Any]:
    if len(blob) < 8:
        raise FheliumValueError(f"fhelium value blob is truncated: {len(blob)} bytes, no safetensors header")
    (header_size,) = struct.unpack("<Q", bytes(blob[:8]))
    if header_size > MAX_HEADER_BYTES or 8 + header_size > len(blob):
        raise FheliumValueError(
            f"fhelium value header claims {header_size} bytes (limit {MAX_HEADER_BYTES}, blob {len(blob)} "
            "bytes)"
        )
    try:
        header = json.loads(bytes(blob[8 : 8 + header_size]))
    except ValueError as error:
        raise FheliumValueError(f"fhelium value header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise FheliumValueError("fhelium value header must be a JSON object")
    return header


def inspect_bytes(blob: bytes | memoryview) -> dict[str, Any]:
    """Validate the header of a serialized value and return its manifest (no tensor is read)."""
    header = _read_header(blob)
    metadata = header.get("__metadata__") or {}
    if metadata.get("fhelium.format") != FILE_FORMAT:
        raise FheliumValueError(
            f"not an fhelium value: format {metadata.get('fhelium.format')!r}, expected {FILE_FORMAT!r}"
        )
    if metadata.get("fhelium.schema_version") != str(FILE_SCHEMA_VERSION):
        raise FheliumValueError(
            f"unsupported fhelium file schema version {metadata.get('fhelium.schema_version')!r}; "
            f"this fhelium reads version {FILE_SCHEMA_VERSION}"
        )
    try:
        manifest = json.loads(metadata["fhelium.manifest"])
    except (KeyError, ValueError):
        raise FheliumValueError("fhelium value header has no readable fhelium.manifest") from None
    tensor_metadata = {}
    complex_names = manifest.get("complex_tensors", [])
    if not isinstance(complex_names, list) or not set(complex_names) <= set(manifest.get("tensor_names", [])):
        raise FheliumValueError(f"fhelium manifest complex_tensors is invalid: {complex_names!r}")
    for name in manifest.get("tensor_names", []):
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise FheliumValueError(f"fhelium value header lacks a usable entry for tensor {name!r}")
        shape, dtype = tuple(entry["shape"]), _DTYPES[entry["dtype"]]
        if name in complex_names:
            if not shape or shape[-1] != 2 or dtype not in (torch.float64, torch.float32):
                raise FheliumValueError(
                    f"complex tensor {name!r} must be stored as float (..., 2); got {shape}"
                )
            shape, dtype = shape[:-1], torch.complex128 if dtype == torch.float64 else torch.complex64
        tensor_metadata[name] = {"shape": shape, "dtype": dtype}
    extra = sorted(set(header) - {"__metadata__"} - set(tensor_metadata))
    if extra:
        raise FheliumValueError(f"fhelium value blob holds tensors its manifest does not name: {extra}")
    validate_value_description(
        schema_version=manifest.get("value_schema_version"),
        value_type=manifest.get("value_type"),
        metadata=manifest.get("value_metadata"),
        tensor_names=list(manifest.get("tensor_names", [])),
        tensor_metadata=tensor_metadata,
    )
    return dict(manifest)


def check_against_engine(value: object, engine: EngineLike, *, moduli: list[str] | None = None) -> None:
    """Raise ParameterMismatchError unless ring degree, primes and residue ranges fit ``engine``."""
    envelope = ValueEnvelope.from_value(value)
    prime_ids = envelope.metadata.get("prime_ids") or []
    if not prime_ids:
        return
    first = next(iter(envelope.tensors.values()))
    if first.size(-1) != engine.ring_degree:
        raise ParameterMismatchError(
            f"{envelope.value_type} has ring dimension {first.size(-1)}; the engine uses "
            f"N={engine.ring_degree}"
        )
    expected = engine.moduli_for(prime_ids)
    if moduli is not None and [int(q) for q in moduli] != expected:
        raise ParameterMismatchError(
            f"{envelope.value_type} was made with primes {moduli} for ids {prime_ids}; this engine has "
            f"{[str(q) for q in expected]} (different parameters)"
        )
    q = torch.tensor(expected, dtype=torch.int64).unsqueeze(-1)
    for name, tensor in envelope.tensors.items():
        if tensor.dtype not in (torch.int64, torch.int32) or name == "implicit_data":
            continue
        cpu = tensor.cpu().long()
        if bool((cpu < 0).any()) or bool((cpu >= q).any()):
            raise ParameterMismatchError(
                f"{envelope.value_type} tensor {name!r} holds residues outside [0, q) for its primes"
            )


def value_from_bytes(
    blob: bytes | memoryview,
    *,
    engine: EngineLike | None = None,
    expected_type: str | None = None,
    device: torch.device | str = "cpu",
) -> FheliumValue:
    manifest = inspect_bytes(blob)
    if expected_type is not None and manifest["value_type"] != expected_type:
        raise FheliumValueError(f"expected a serialized {expected_type}; got {manifest['value_type']}")
    tensors = safetensors.torch.load(bytes(blob))
    names = manifest["tensor_names"]
    complex_names = set(manifest.get("complex_tensors", []))
    restored = {
        name: (torch.view_as_complex(tensors[name]) if name in complex_names else tensors[name]).to(device)
        for name in names
    }
    envelope = ValueEnvelope(
        manifest["value_schema_version"], manifest["value_type"], manifest["value_metadata"], restored
    )
    value = envelope.to_value()
    if engine is not None:
        check_against_engine(value, engine, moduli=manifest.get("moduli"))
    return value


def save_value(
    value: object,
    path: str | os.PathLike[str],
    *,
    engine: EngineLike | None = None,
    allow_secret: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write atomically (temp file + rename), mode 0600; refuses to overwrite unless asked."""
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    blob = value_to_bytes(value, engine=engine, allow_secret=allow_secret)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(blob)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def load_value(
    path: str | os.PathLike[str],
    *,
    engine: EngineLike | None = None,
    expected_type: str | None = None,
    device: torch.device | str = "cpu",
) -> FheliumValue:
    return value_from_bytes(
        Path(path).read_bytes(), engine=engine, expected_type=expected_type, device=device
    )


def inspect_value(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise FheliumValueError(f"{path} is too short to be an fhelium value")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES:
            raise FheliumValueError(f"{path} header claims {size} bytes (limit {MAX_HEADER_BYTES})")
        header = prefix + handle.read(size)
    return inspect_bytes(header)


__all__ = [
    "FILE_FORMAT",
    "FILE_SCHEMA_VERSION",
    "check_against_engine",
    "inspect_bytes",
    "inspect_value",
    "load_value",
    "save_value",
    "value_from_bytes",
    "value_to_bytes",
]
