"""The tensor-leaf schema of every fhelium value, shared by files, bytes and distributed transfer.

A ``ValueEnvelope`` splits a value into JSON-safe metadata and named tensors.
``validate_value_description`` checks the metadata and tensor names **without any tensor**, so a
receiver can refuse a bad description before reading or allocating a payload.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fhelium.core import (
    KEY_TYPES,
    AnyKey,
    Ciphertext,
    CompressedPlaintext,
    FheliumValueError,
    Plaintext,
    RotationKey,
    SecretKey,
    SeededCiphertext,
)
from fhelium.core.compressed import COMPRESSED_PLAINTEXT_FORMAT_VERSION
from fhelium.core.state import (
    COMPRESSED_PLAINTEXT_LAYOUTS,
    MODULUS_BASES,
    PLAINTEXT_REPRESENTATIONS,
    POLYNOMIAL_DOMAINS,
    RESIDUE_REPRESENTATIONS,
)

# 2: keys and seeded ciphertexts come from the domain-separated keystream (expansion version 2,
# fhelium/engine/sampling.py). Version 1 keys leaked their secret through the public key's
# uniform part, and version 1 seeds expand to a different c1, so version 1 is refused.
VALUE_SCHEMA_VERSION = 2
_COMPROMISED_SCHEMA_VERSIONS = frozenset({1})

FheliumValue = Ciphertext | Plaintext | CompressedPlaintext | AnyKey | SeededCiphertext

_KEY_TYPES: dict[str, type] = {kind.__name__: kind for kind in KEY_TYPES}
VALUE_TYPES: dict[str, type] = {
    "Ciphertext": Ciphertext,
    "Plaintext": Plaintext,
    "CompressedPlaintext": CompressedPlaintext,
    "SeededCiphertext": SeededCiphertext,
    **_KEY_TYPES,
}
KEY_VALUE_TYPES = frozenset(_KEY_TYPES)



@dataclass(frozen=True)
class ValueTypeExtension:
    """A value type defined outside ``fhelium.core`` (e.g. ``fhelium.multiparty``'s shares).

    ``validate(metadata, tensor_metadata)`` checks the metadata (every field present, none extra,
    is checked here first) and, when given, the tensors' shapes and dtypes, without any payload;
    it raises ``FheliumValueError``. ``describe(value)`` gives (metadata, tensors) and
    ``build(metadata, tensors)`` rebuilds the value. ``secret`` values are serialized only with
    ``allow_secret=True``.
    """

    name: str
    cls: type
    metadata_fields: tuple[str, ...]
    tensor_names: Callable[[Mapping[str, Any]], tuple[str, ...]]
    validate: Callable[[Mapping[str, Any], Mapping[str, Mapping[str, Any]] | None], None]
    describe: Callable[[Any], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    build: Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]], Any]
    secret: bool = False


# Extension value types register themselves when their module is imported; `import fhelium` imports
# fhelium.multiparty.values (the package root sits above every layer), so a reader that loads a share
# from bytes finds it registered without an import of its own, and nothing here names a module above.
_EXTENSIONS: dict[str, ValueTypeExtension] = {}


def register_value_type(extension: ValueTypeExtension) -> None:
    """Make an extension value type known to envelopes, bytes and files (idempotent per class)."""
    known = _EXTENSIONS.get(extension.name)
    if extension.name in VALUE_TYPES or (known is not None and known.cls is not extension.cls):
        raise FheliumValueError(f"value type {extension.name!r} is already registered")
    _EXTENSIONS[extension.name] = extension


def value_type_extension(name: object) -> ValueTypeExtension | None:
    """The registered extension of that name, else None."""
    if not isinstance(name, str):
        return None
    return _EXTENSIONS.get(name)


def is_secret_value(value: object) -> bool:
    if isinstance(value, SecretKey):
        return True
    extension = value_type_extension(type(value).__name__)
    return extension is not None and extension.cls is type(value) and extension.secret


_RNS_FIELDS = ("prime_ids", "polynomial_domain", "modulus_basis", "residue_representation")
METADATA_FIELDS: dict[str, tuple[str, ...]] = {
    "Ciphertext": ("depth", "scale", *_RNS_FIELDS),
    "Plaintext": ("depth", "scale", "representation", *_RNS_FIELDS, "has_message", "has_data"),
    "CompressedPlaintext": (
        "ring_dimension",
        "compression_layout",
        "compression_format_version",
        "depth",
        "scale",
        *_RNS_FIELDS,
        "has_implicit_data",
    ),
    "SeededCiphertext": ("depth", "scale", "prime_ids", "polynomial_domain", "seed_hex"),
    **{name: _RNS_FIELDS for name in _KEY_TYPES},
}
METADATA_FIELDS["RotationKey"] = (*_RNS_FIELDS, "rotation_step")


def expected_tensor_names(value_type: str, metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """Tensor names in payload order for a (validated) description."""
    extension = value_type_extension(value_type) if value_type not in VALUE_TYPES else None
    if extension is not None:
        return extension.tensor_names(metadata)
    if value_type == "Plaintext":
        names = []
        if metadata.get("has_message"):
            names.append("message")
        if metadata.get("has_data"):
            names.append("data")
        return tuple(names)
    if value_type == "CompressedPlaintext" and metadata.get("has_implicit_data"):
        return ("data", "implicit_data")
    if value_type == "SeededCiphertext":
        return ("c0",)
    return ("data",)


def _fail(value_type: str, message: str) -> FheliumValueError:
    return FheliumValueError(f"{value_type} envelope {message}")


def _check_int(value_type: str, name: str, value: object, *, minimum: int = 0) -> None:
    if type(value) is not int or value < minimum:
        raise _fail(value_type, f"{name} must be an int >= {minimum}; got {value!r}")


def _check_enum(
    value_type: str, name: str, value: object, choices: tuple[str, ...], *, optional: bool
) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in choices:
        raise _fail(value_type, f"{name} must be one of {list(choices)}; got {value!r}")


def _check_scale(value_type: str, value: object) -> None:
    if type(value) not in (int, float) or not math.isfinite(float(value)) or float(value) <= 0:  # type: ignore[arg-type]  # checked just before
        raise _fail(value_type, f"scale must be a positive finite float; got {value!r}")


def _check_prime_ids(value_type: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, (list, tuple)):
        raise _fail(value_type, f"prime_ids must be a list of ints; got {value!r}")
    if not value and not allow_empty:
        raise _fail(value_type, "prime_ids must not be empty")
    if any(type(item) is not int or item < 0 for item in value):
        raise _fail(value_type, f"prime_ids must be non-negative ints; got {list(value)}")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise _fail(value_type, f"prime_ids must be strictly increasing: {list(value)}")


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
    extension = value_type_extension(value_type) if value_type not in VALUE_TYPES else None
    if extension is not None:
        _validate_extension(extension, metadata, tensor_names, tensor_metadata)
        return
    if not isinstance(value_type, str) or value_type not in VALUE_TYPES:
        raise FheliumValueError(
            f"Unsupported value envelope value_type: {value_type!r}; expected one of {sorted(VALUE_TYPES)}"
        )
    if not isinstance(metadata, Mapping):
        raise _fail(value_type, f"metadata must be a mapping; got {type(metadata).__name__}")
    expected = set(METADATA_FIELDS[value_type])
    actual = set(metadata)
    if expected - actual:
        raise _fail(value_type, f"metadata is missing fields: {sorted(expected - actual)}")
    if actual - expected:
        raise _fail(value_type, f"metadata has unexpected fields: {sorted(actual - expected)}")

    rns_optional = value_type == "Plaintext"
    _check_enum(
        value_type,
        "polynomial_domain",
        metadata["polynomial_domain"],
        POLYNOMIAL_DOMAINS,
        optional=rns_optional,
    )
    if value_type == "SeededCiphertext":
        seed_hex = metadata["seed_hex"]
        if (
            not isinstance(seed_hex, str)
            or len(seed_hex) != 64
            or any(c not in "0123456789abcdef" for c in seed_hex)
        ):
            raise _fail(value_type, "seed_hex must be 64 lowercase hex characters (a 32-byte seed)")
    else:
        _check_enum(
            value_type, "modulus_basis", metadata["modulus_basis"], MODULUS_BASES, optional=rns_optional
        )
        _check_enum(
            value_type,
            "residue_representation",
            metadata["residue_representation"],
            RESIDUE_REPRESENTATIONS,
            optional=rns_optional,
        )
    _check_prime_ids(value_type, metadata["prime_ids"], allow_empty=rns_optional)
    if "depth" in expected:
        _check_int(value_type, "depth", metadata["depth"])
        _check_scale(value_type, metadata["scale"])
    if value_type == "Ciphertext" and (
        metadata["polynomial_domain"] == "coefficient" and metadata["residue_representation"] == "montgomery"
    ):
        raise _fail(value_type, "describes a coefficient-domain ciphertext with Montgomery residues")
    if value_type == "Plaintext":
        _check_enum(
            value_type,
            "representation",
            metadata["representation"],
            PLAINTEXT_REPRESENTATIONS,
            optional=False,
        )
        for flag in ("has_message", "has_data"):
            if type(metadata[flag]) is not bool:
                raise _fail(value_type, f"{flag} must be a bool; got {metadata[flag]!r}")
        if metadata["has_message"] == metadata["has_data"]:
            raise _fail(value_type, "must carry exactly one of message and data")
        if (metadata["representation"] == "slots") != metadata["has_message"]:
            raise _fail(value_type, "representation 'slots' goes with message, every other with data")
        if metadata["representation"] == "rns" and (
            None
            in (metadata["polynomial_domain"], metadata["modulus_basis"], metadata["residue_representation"])
            or not metadata["prime_ids"]
        ):
            raise _fail(value_type, "rns representation needs domain, basis, residue form and prime_ids")
    if value_type == "CompressedPlaintext":
        _check_int(value_type, "ring_dimension", metadata["ring_dimension"], minimum=1)
        _check_enum(
            value_type,
            "compression_layout",
            metadata["compression_layout"],
            COMPRESSED_PLAINTEXT_LAYOUTS,
            optional=False,
        )
        if (
            metadata["compression_format_version"] != COMPRESSED_PLAINTEXT_FORMAT_VERSION
            or type(metadata["compression_format_version"]) is not int
        ):
            raise _fail(
                value_type, f"compression_format_version must be {COMPRESSED_PLAINTEXT_FORMAT_VERSION}"
            )
        if type(metadata["has_implicit_data"]) is not bool:
            raise _fail(value_type, "has_implicit_data must be a bool")
        if metadata["has_implicit_data"] != (metadata["compression_layout"] == "strided_sparse"):
            raise _fail(value_type, "has_implicit_data must be true exactly for the strided_sparse layout")
    if value_type == "RotationKey" and type(metadata["rotation_step"]) is not int:
        raise _fail(value_type, f"rotation_step must be an int; got {metadata['rotation_step']!r}")

    names = list(tensor_names)
    wanted = list(expected_tensor_names(value_type, metadata))
    if names != wanted:
        raise _fail(value_type, f"tensor names do not match its metadata: expected={wanted}, actual={names}")
    if tensor_metadata is not None:
        _check_tensor_metadata(value_type, metadata, wanted, tensor_metadata)


def _validate_extension(
    extension: ValueTypeExtension,
    metadata: object,
    tensor_names: Sequence[str],
    tensor_metadata: Mapping[str, Mapping[str, Any]] | None,
) -> None:
    name = extension.name
    if not isinstance(metadata, Mapping):
        raise _fail(name, f"metadata must be a mapping; got {type(metadata).__name__}")
    expected, actual = set(extension.metadata_fields), set(metadata)
    if expected - actual:
        raise _fail(name, f"metadata is missing fields: {sorted(expected - actual)}")
    if actual - expected:
        raise _fail(name, f"metadata has unexpected fields: {sorted(actual - expected)}")
    extension.validate(metadata, None)
    wanted = list(extension.tensor_names(metadata))
    if list(tensor_names) != wanted:
        raise _fail(
            name, f"tensor names do not match its metadata: expected={wanted}, actual={list(tensor_names)}"
        )
    if tensor_metadata is not None:
        if sorted(tensor_metadata) != sorted(wanted):
            raise _fail(name, f"tensor metadata names {sorted(tensor_metadata)} differ from {sorted(wanted)}")
        for tensor_name in wanted:
            shape = tensor_metadata[tensor_name].get("shape")
            if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
                raise _fail(
                    name,
                    f"tensor {tensor_name!r} shape must be a sequence of non-negative ints; got {shape!r}",
                )
            _check_span(name, tensor_name, shape)
        extension.validate(metadata, tensor_metadata)


_LEADING_AXES = {
    "SecretKey": 0,
    "PublicKey": 1,
    "KeySwitchKey": 2,
    "RotationKey": 2,
    "RelinearizationKey": 2,
    "ConjugationKey": 2,
}


# Bound on a tensor's extent product with zero extents counted as one: torch computes contiguous
# strides from every extent, so a zero-element shape such as [0] + [2**40 - 1] * 7 holds no bytes
# yet overflows them (a RuntimeError deep in torch instead of a value error). 2**44 elements of
# at most 16 bytes stay far below int64 and far above any real value.
MAX_SHAPE_SPAN_ELEMENTS = 2**44


def _check_span(value_type: str, name: str, shape: Sequence[int]) -> None:
    span = 1
    for extent in shape:
        span *= max(extent, 1)
        if span > MAX_SHAPE_SPAN_ELEMENTS:
            raise _fail(
                value_type,
                f"tensor {name!r} shape {list(shape)} spans over {MAX_SHAPE_SPAN_ELEMENTS} elements "
                "(zero extents counted as one, as torch's strides count them)",
            )


def _check_tensor_metadata(
    value_type: str,
    metadata: Mapping[str, Any],
    names: list[str],
    tensor_metadata: Mapping[str, Mapping[str, Any]],
) -> None:
    if sorted(tensor_metadata) != sorted(names):
        raise _fail(
            value_type, f"tensor metadata names {sorted(tensor_metadata)} differ from {sorted(names)}"
        )
    for name in names:
        entry = tensor_metadata[name]
        shape = entry.get("shape")
        if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
            raise _fail(
                value_type, f"tensor {name!r} shape must be a sequence of non-negative ints; got {shape!r}"
            )
        _check_span(value_type, name, shape)
        dtype = str(entry.get("dtype", "")).removeprefix("torch.")
        float_ok = value_type == "Plaintext" and (
            name == "message" or metadata["representation"] == "approximate_coefficients"
        )
        if not float_ok and dtype not in ("int64", "int32"):
            raise _fail(value_type, f"tensor {name!r} must be int64 or int32; got {dtype}")
    prime_count = len(metadata["prime_ids"])
    data_shape = tuple(tensor_metadata[names[0]]["shape"])
    limb_axis: int | None = None
    if value_type == "Ciphertext":
        if len(data_shape) < 3 or data_shape[0] not in (2, 3):
            raise _fail(value_type, f"data shape must be [2|3, *batch, limb, N]; got {data_shape}")
        limb_axis = len(data_shape) - 2
    elif value_type in _LEADING_AXES:
        if len(data_shape) != _LEADING_AXES[value_type] + 2:
            raise _fail(
                value_type, f"data must have {_LEADING_AXES[value_type] + 2} dimensions; got {data_shape}"
            )
        limb_axis = len(data_shape) - 2
    elif value_type in ("CompressedPlaintext", "SeededCiphertext") or metadata.get("representation") == "rns":
        if len(data_shape) < 2:
            raise _fail(value_type, f"data shape must be [*batch, limb, N]; got {data_shape}")
        limb_axis = len(data_shape) - 2
    if limb_axis is not None and data_shape[limb_axis] != prime_count:
        raise _fail(
            value_type,
            f"limb axis has {data_shape[limb_axis]} rows but prime_ids names {prime_count} primes",
        )


def _rns_metadata(value: Any) -> dict[str, Any]:  # noqa: ANN401  a VALUE_TYPES key type, checked by the caller
    return {
        "prime_ids": list(value.prime_ids),
        "polynomial_domain": value.polynomial_domain,
        "modulus_basis": value.modulus_basis,
        "residue_representation": value.residue_representation,
    }


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
        value_type = type(value).__name__
        extension = value_type_extension(value_type) if value_type not in VALUE_TYPES else None
        if extension is not None and extension.cls is type(value):
            ext_metadata, ext_tensors = extension.describe(value)
            return cls(VALUE_SCHEMA_VERSION, value_type, ext_metadata, ext_tensors)
        if VALUE_TYPES.get(value_type) is not type(value):
            raise FheliumValueError(
                f"Value envelopes support exact fhelium values {sorted(VALUE_TYPES)}; got "
                f"{type(value).__qualname__}"
            )
        metadata: dict[str, Any]
        tensors: dict[str, torch.Tensor]
        if isinstance(value, Ciphertext):
            metadata = {"depth": value.depth, "scale": value.scale, **_rns_metadata(value)}
            tensors = {"data": value.data}
        elif isinstance(value, Plaintext):
            metadata = {
                "depth": value.depth,
                "scale": value.scale,
                "representation": value.representation,
                **_rns_metadata(value),
                "has_message": value.message is not None,
                "has_data": value.data is not None,
            }
            if value.representation != "rns":
                metadata["polynomial_domain"] = value.polynomial_domain if value.data is not None else None
            tensors = {"message": value.message} if value.message is not None else {"data": value.tensor}
        elif isinstance(value, CompressedPlaintext):
            metadata = {
                "ring_dimension": value.ring_dimension,
                "compression_layout": value.compression_layout,
                "compression_format_version": value.compression_format_version,
                "depth": value.depth,
                "scale": value.scale,
                **_rns_metadata(value),
                "has_implicit_data": value.implicit_data is not None,
            }
            tensors = {"data": value.data}
            if value.implicit_data is not None:
                tensors["implicit_data"] = value.implicit_data
        elif isinstance(value, SeededCiphertext):
            metadata = {
                "depth": value.depth,
                "scale": value.scale,
                "prime_ids": list(value.prime_ids),
                "polynomial_domain": value.polynomial_domain,
                "seed_hex": value.seed.hex(),
            }
            tensors = {"c0": value.c0}
        else:
            metadata = _rns_metadata(value)
            if isinstance(value, RotationKey):
                metadata["rotation_step"] = value.rotation_step
            tensors = {"data": value.data}  # type: ignore[attr-defined]  # every key has data
        return cls(VALUE_SCHEMA_VERSION, value_type, metadata, tensors)

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
        m = self.metadata
        extension = value_type_extension(self.value_type) if self.value_type not in VALUE_TYPES else None
        if extension is not None:
            built: FheliumValue = extension.build(m, self.tensors)
            return built
        if self.value_type == "SeededCiphertext":
            return SeededCiphertext(
                self.tensors["c0"],
                bytes.fromhex(m["seed_hex"]),
                m["depth"],
                m["scale"],
                tuple(m["prime_ids"]),
                m["polynomial_domain"],
            )
        rns = (
            tuple(m["prime_ids"]),
            m["polynomial_domain"],
            m["modulus_basis"],
            m["residue_representation"],
        )
        if self.value_type == "Ciphertext":
            return Ciphertext(self.tensors["data"], m["depth"], m["scale"], *rns)
        if self.value_type == "Plaintext":
            return Plaintext(
                self.tensors.get("message"),
                m["depth"],
                m["scale"],
                self.tensors.get("data"),
                m["representation"],
                m["polynomial_domain"],
                m["modulus_basis"],
                m["residue_representation"],
                tuple(m["prime_ids"]),
            )
        if self.value_type == "CompressedPlaintext":
            return CompressedPlaintext(
                self.tensors["data"],
                m["ring_dimension"],
                m["compression_layout"],
                m["depth"],
                m["scale"],
                *rns,
                self.tensors.get("implicit_data"),
                m["compression_format_version"],
            )
        if self.value_type == "RotationKey":
            return RotationKey(self.tensors["data"], *rns, rotation_step=m["rotation_step"])
        key_type = _KEY_TYPES[self.value_type]
        key: FheliumValue = key_type(self.tensors["data"], *rns)
        return key

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
