"""The codecs of the ``fhelium.core`` value types, registered in ``fhelium.serialization.registry``.

One ``ValueCodec`` per type: Ciphertext, Plaintext, CompressedPlaintext, SeededCiphertext and each
key type. Their metadata, tensor names and checks define the wire format (docs/fhelium-values.md);
changing one changes bytes on disk and on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fhelium.core import (
    KEY_TYPES,
    Ciphertext,
    CompressedPlaintext,
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
from fhelium.serialization.registry import (
    Validator,
    ValueCodec,
    check_enum,
    check_int,
    check_prime_ids,
    check_scale,
    fail,
    register_core_value_type,
)

TensorMetadata = Mapping[str, Mapping[str, Any]]

_RNS_FIELDS = ("prime_ids", "polynomial_domain", "modulus_basis", "residue_representation")


# --------------------------------------------------------------------------- shared checks


def _check_rns_forms(name: str, m: Mapping[str, Any], *, optional: bool) -> None:
    check_enum(name, "polynomial_domain", m["polynomial_domain"], POLYNOMIAL_DOMAINS, optional=optional)
    check_enum(name, "modulus_basis", m["modulus_basis"], MODULUS_BASES, optional=optional)
    check_enum(
        name,
        "residue_representation",
        m["residue_representation"],
        RESIDUE_REPRESENTATIONS,
        optional=optional,
    )


def _check_level(name: str, m: Mapping[str, Any]) -> None:
    check_int(name, "depth", m["depth"])
    check_scale(name, m["scale"])


def _check_int_dtypes(
    name: str, names: Sequence[str], tm: TensorMetadata, *, float_ok: Sequence[str] = ()
) -> None:
    for tensor_name in names:
        dtype = str(tm[tensor_name].get("dtype", "")).removeprefix("torch.")
        if tensor_name not in float_ok and dtype not in ("int64", "int32"):
            raise fail(name, f"tensor {tensor_name!r} must be int64 or int32; got {dtype}")


def _check_limb_rows(name: str, m: Mapping[str, Any], shape: tuple[int, ...]) -> None:
    prime_count = len(m["prime_ids"])
    if shape[-2] != prime_count:
        raise fail(name, f"limb axis has {shape[-2]} rows but prime_ids names {prime_count} primes")


def _check_batched_limbs(name: str, m: Mapping[str, Any], shape: tuple[int, ...]) -> None:
    if len(shape) < 2:
        raise fail(name, f"data shape must be [*batch, limb, N]; got {shape}")
    _check_limb_rows(name, m, shape)


def _rns_metadata(value: Any) -> dict[str, Any]:  # noqa: ANN401  a core value with RNS state
    return {
        "prime_ids": list(value.prime_ids),
        "polynomial_domain": value.polynomial_domain,
        "modulus_basis": value.modulus_basis,
        "residue_representation": value.residue_representation,
    }


def _rns_args(m: Mapping[str, Any]) -> tuple[tuple[int, ...], Any, Any, Any]:
    return (tuple(m["prime_ids"]), m["polynomial_domain"], m["modulus_basis"], m["residue_representation"])


def _data_only(m: Mapping[str, Any]) -> tuple[str, ...]:
    return ("data",)


# --------------------------------------------------------------------------- Ciphertext


def _validate_ciphertext(m: Mapping[str, Any], tm: TensorMetadata | None) -> None:
    name = "Ciphertext"
    _check_rns_forms(name, m, optional=False)
    check_prime_ids(name, m["prime_ids"], allow_empty=False)
    _check_level(name, m)
    if m["polynomial_domain"] == "coefficient" and m["residue_representation"] == "montgomery":
        raise fail(name, "describes a coefficient-domain ciphertext with Montgomery residues")
    if tm is None:
        return
    _check_int_dtypes(name, ("data",), tm)
    shape = tuple(tm["data"]["shape"])
    if len(shape) < 3 or shape[0] not in (2, 3):
        raise fail(name, f"data shape must be [2|3, *batch, limb, N]; got {shape}")
    _check_limb_rows(name, m, shape)


def _describe_ciphertext(value: Ciphertext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return {"depth": value.depth, "scale": value.scale, **_rns_metadata(value)}, {"data": value.data}


def _build_ciphertext(m: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> Ciphertext:
    return Ciphertext(t["data"], m["depth"], m["scale"], *_rns_args(m))


# --------------------------------------------------------------------------- Plaintext


def _plaintext_tensor_names(m: Mapping[str, Any]) -> tuple[str, ...]:
    names = []
    if m.get("has_message"):
        names.append("message")
    if m.get("has_data"):
        names.append("data")
    return tuple(names)


def _check_plaintext_form(name: str, m: Mapping[str, Any]) -> None:
    check_enum(name, "representation", m["representation"], PLAINTEXT_REPRESENTATIONS, optional=False)
    for flag in ("has_message", "has_data"):
        if type(m[flag]) is not bool:
            raise fail(name, f"{flag} must be a bool; got {m[flag]!r}")
    if m["has_message"] == m["has_data"]:
        raise fail(name, "must carry exactly one of message and data")
    if (m["representation"] == "slots") != m["has_message"]:
        raise fail(name, "representation 'slots' goes with message, every other with data")
    rns_state = (m["polynomial_domain"], m["modulus_basis"], m["residue_representation"])
    if m["representation"] == "rns" and (None in rns_state or not m["prime_ids"]):
        raise fail(name, "rns representation needs domain, basis, residue form and prime_ids")


def _validate_plaintext(m: Mapping[str, Any], tm: TensorMetadata | None) -> None:
    name = "Plaintext"
    _check_rns_forms(name, m, optional=True)
    check_prime_ids(name, m["prime_ids"], allow_empty=True)
    _check_level(name, m)
    _check_plaintext_form(name, m)
    if tm is None:
        return
    names = _plaintext_tensor_names(m)
    float_ok = names if m["representation"] == "approximate_coefficients" else ("message",)
    _check_int_dtypes(name, names, tm, float_ok=float_ok)
    if m["representation"] == "rns":
        _check_batched_limbs(name, m, tuple(tm[names[0]]["shape"]))


def _describe_plaintext(value: Plaintext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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
    return metadata, tensors


def _build_plaintext(m: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> Plaintext:
    return Plaintext(
        t.get("message"),
        m["depth"],
        m["scale"],
        t.get("data"),
        m["representation"],
        m["polynomial_domain"],
        m["modulus_basis"],
        m["residue_representation"],
        tuple(m["prime_ids"]),
    )


# --------------------------------------------------------------------------- CompressedPlaintext


def _compressed_tensor_names(m: Mapping[str, Any]) -> tuple[str, ...]:
    return ("data", "implicit_data") if m.get("has_implicit_data") else ("data",)


def _validate_compressed(m: Mapping[str, Any], tm: TensorMetadata | None) -> None:
    name = "CompressedPlaintext"
    _check_rns_forms(name, m, optional=False)
    check_prime_ids(name, m["prime_ids"], allow_empty=False)
    _check_level(name, m)
    check_int(name, "ring_dimension", m["ring_dimension"], minimum=1)
    check_enum(
        name, "compression_layout", m["compression_layout"], COMPRESSED_PLAINTEXT_LAYOUTS, optional=False
    )
    version = m["compression_format_version"]
    if version != COMPRESSED_PLAINTEXT_FORMAT_VERSION or type(version) is not int:
        raise fail(name, f"compression_format_version must be {COMPRESSED_PLAINTEXT_FORMAT_VERSION}")
    if type(m["has_implicit_data"]) is not bool:
        raise fail(name, "has_implicit_data must be a bool")
    if m["has_implicit_data"] != (m["compression_layout"] == "strided_sparse"):
        raise fail(name, "has_implicit_data must be true exactly for the strided_sparse layout")
    if tm is None:
        return
    _check_int_dtypes(name, _compressed_tensor_names(m), tm)
    _check_batched_limbs(name, m, tuple(tm["data"]["shape"]))


def _describe_compressed(value: CompressedPlaintext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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
    return metadata, tensors


def _build_compressed(m: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> CompressedPlaintext:
    return CompressedPlaintext(
        t["data"],
        m["ring_dimension"],
        m["compression_layout"],
        m["depth"],
        m["scale"],
        *_rns_args(m),
        t.get("implicit_data"),
        m["compression_format_version"],
    )


# --------------------------------------------------------------------------- SeededCiphertext


def _validate_seeded(m: Mapping[str, Any], tm: TensorMetadata | None) -> None:
    name = "SeededCiphertext"
    check_enum(name, "polynomial_domain", m["polynomial_domain"], POLYNOMIAL_DOMAINS, optional=False)
    seed_hex = m["seed_hex"]
    if (
        not isinstance(seed_hex, str)
        or len(seed_hex) != 64
        or any(c not in "0123456789abcdef" for c in seed_hex)
    ):
        raise fail(name, "seed_hex must be 64 lowercase hex characters (a 32-byte seed)")
    check_prime_ids(name, m["prime_ids"], allow_empty=False)
    _check_level(name, m)
    if tm is None:
        return
    _check_int_dtypes(name, ("c0",), tm)
    _check_batched_limbs(name, m, tuple(tm["c0"]["shape"]))


def _describe_seeded(value: SeededCiphertext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    metadata = {
        "depth": value.depth,
        "scale": value.scale,
        "prime_ids": list(value.prime_ids),
        "polynomial_domain": value.polynomial_domain,
        "seed_hex": value.seed.hex(),
    }
    return metadata, {"c0": value.c0}


def _build_seeded(m: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> SeededCiphertext:
    return SeededCiphertext(
        t["c0"],
        bytes.fromhex(m["seed_hex"]),
        m["depth"],
        m["scale"],
        tuple(m["prime_ids"]),
        m["polynomial_domain"],
    )


# --------------------------------------------------------------------------- keys

# Leading axes of each key's data before [limb, N].
_KEY_LEADING_AXES = {
    "SecretKey": 0,
    "PublicKey": 1,
    "KeySwitchKey": 2,
    "RotationKey": 2,
    "RelinearizationKey": 2,
    "ConjugationKey": 2,
}


def _key_validator(name: str) -> Validator:
    ndim = _KEY_LEADING_AXES[name] + 2

    def validate(m: Mapping[str, Any], tm: TensorMetadata | None) -> None:
        _check_rns_forms(name, m, optional=False)
        check_prime_ids(name, m["prime_ids"], allow_empty=False)
        if name == "RotationKey" and type(m["rotation_step"]) is not int:
            raise fail(name, f"rotation_step must be an int; got {m['rotation_step']!r}")
        if tm is None:
            return
        _check_int_dtypes(name, ("data",), tm)
        shape = tuple(tm["data"]["shape"])
        if len(shape) != ndim:
            raise fail(name, f"data must have {ndim} dimensions; got {shape}")
        _check_limb_rows(name, m, shape)

    return validate


def _describe_key(value: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:  # noqa: ANN401  any key type
    metadata = _rns_metadata(value)
    if isinstance(value, RotationKey):
        metadata["rotation_step"] = value.rotation_step
    return metadata, {"data": value.data}


def _key_builder(key_type: type) -> Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]], Any]:
    if key_type is RotationKey:
        return lambda m, t: RotationKey(t["data"], *_rns_args(m), rotation_step=m["rotation_step"])
    return lambda m, t: key_type(t["data"], *_rns_args(m))


def _key_codec(key_type: type) -> ValueCodec:
    name = key_type.__name__
    fields = (*_RNS_FIELDS, "rotation_step") if key_type is RotationKey else _RNS_FIELDS
    return ValueCodec(
        name,
        key_type,
        fields,
        _data_only,
        _key_validator(name),
        _describe_key,
        _key_builder(key_type),
        secret=key_type is SecretKey,
    )


# --------------------------------------------------------------------------- registration

CORE_CODECS: tuple[ValueCodec, ...] = (
    ValueCodec(
        "Ciphertext",
        Ciphertext,
        ("depth", "scale", *_RNS_FIELDS),
        _data_only,
        _validate_ciphertext,
        _describe_ciphertext,
        _build_ciphertext,
    ),
    ValueCodec(
        "Plaintext",
        Plaintext,
        ("depth", "scale", "representation", *_RNS_FIELDS, "has_message", "has_data"),
        _plaintext_tensor_names,
        _validate_plaintext,
        _describe_plaintext,
        _build_plaintext,
    ),
    ValueCodec(
        "CompressedPlaintext",
        CompressedPlaintext,
        (
            "ring_dimension",
            "compression_layout",
            "compression_format_version",
            "depth",
            "scale",
            *_RNS_FIELDS,
            "has_implicit_data",
        ),
        _compressed_tensor_names,
        _validate_compressed,
        _describe_compressed,
        _build_compressed,
    ),
    ValueCodec(
        "SeededCiphertext",
        SeededCiphertext,
        ("depth", "scale", "prime_ids", "polynomial_domain", "seed_hex"),
        lambda m: ("c0",),
        _validate_seeded,
        _describe_seeded,
        _build_seeded,
    ),
    *(_key_codec(key_type) for key_type in KEY_TYPES),
)
KEY_CODEC_NAMES = frozenset(key_type.__name__ for key_type in KEY_TYPES)

for _codec in CORE_CODECS:
    register_core_value_type(_codec)
