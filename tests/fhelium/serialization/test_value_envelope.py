from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.core import (
    Ciphertext,
    CompressedPlaintext,
    ConjugationKey,
    FheliumValueError,
    Plaintext,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
)
from fhelium.serialization import (
    VALUE_SCHEMA_VERSION,
    VALUE_TYPES,
    ValueCodec,
    ValueEnvelope,
    register_value_type,
    validate_value_description,
    value_codec,
    value_type_extension,
)


def _values() -> list[Any]:
    z = torch.zeros
    i64 = torch.int64
    full = torch.full((2, 8), 4, dtype=i64)
    full[:, ::4] = 1
    sparse_pt = Plaintext(None, 0, 1.0, full, "rns", "coefficient", "Q", "standard", (0, 1))
    return [
        Ciphertext(torch.arange(48).reshape(2, 3, 8), 1, 2.0**30, (1, 2, 3), "ntt"),
        Plaintext(torch.randn(4, dtype=torch.float64), 0, 2.0**20),
        Plaintext(None, 0, 2.0**20, torch.arange(8), "integer_coefficients"),
        Plaintext(None, 2, 2.0**20, z(3, 8, dtype=i64), "rns", "ntt", "Q", "standard", (2, 3, 4)),
        CompressedPlaintext.from_plaintext(sparse_pt, unique_count=2, compression_layout="strided_sparse"),
        SecretKey(z(4, 8, dtype=i64), (0, 1, 2, 3)),
        PublicKey(z(2, 3, 8, dtype=i64), (0, 1, 2)),
        RelinearizationKey(z(3, 2, 4, 8, dtype=i64), (0, 1, 2, 3)),
        ConjugationKey(z(3, 2, 4, 8, dtype=i64), (0, 1, 2, 3)),
        RotationKey(z(3, 2, 4, 8, dtype=i64), (0, 1, 2, 3), rotation_step=-2),
    ]


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_envelope_round_trip_preserves_type_metadata_and_storage(value: object) -> None:
    envelope = ValueEnvelope.from_value(value)
    assert envelope.schema_version == VALUE_SCHEMA_VERSION and envelope.value_type == type(value).__name__
    rebuilt = envelope.to_value()
    assert type(rebuilt) is type(value)
    assert ValueEnvelope.from_value(rebuilt).metadata == envelope.metadata
    for name, tensor in envelope.tensors.items():
        assert getattr(rebuilt, name).data_ptr() == tensor.data_ptr()


def test_envelope_refuses_subclasses_and_foreign_objects() -> None:
    class MyCiphertext(Ciphertext):
        pass

    with pytest.raises(FheliumValueError, match="exact fhelium values"):
        ValueEnvelope.from_value(MyCiphertext(torch.zeros(2, 1, 8, dtype=torch.int64), 0, 1.0, (0,)))
    with pytest.raises(FheliumValueError, match="exact fhelium values"):
        ValueEnvelope.from_value(torch.zeros(3))


def _ct_description() -> dict[str, Any]:
    envelope = ValueEnvelope.from_value(_values()[0])
    return {
        "schema_version": envelope.schema_version,
        "value_type": envelope.value_type,
        "metadata": dict(envelope.metadata),
        "tensor_names": list(envelope.tensors),
        "tensor_metadata": {"data": {"shape": (2, 3, 8), "dtype": torch.int64}},
    }


def test_valid_description_passes() -> None:
    validate_value_description(**_ct_description())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema_version=99), "Unsupported value envelope schema version: 99"),
        (lambda d: d.update(value_type="Tensor"), "Unsupported value envelope value_type"),
        (lambda d: d["metadata"].pop("scale"), r"missing fields: \['scale'\]"),
        (lambda d: d["metadata"].update(context_id="x"), r"unexpected fields: \['context_id'\]"),
        (lambda d: d["metadata"].update(prime_ids=[2, 2, 4]), "strictly increasing"),
        (lambda d: d["metadata"].update(depth=1.0), "depth must be an int"),
        (lambda d: d["metadata"].update(scale=-1.0), "scale must be a positive finite"),
        (lambda d: d["metadata"].update(polynomial_domain="x"), "polynomial_domain must be one of"),
        (lambda d: d.update(tensor_names=["data", "extra"]), "tensor names do not match"),
        (
            lambda d: d["tensor_metadata"].update(data={"shape": (2, 4, 8), "dtype": torch.int64}),
            "limb axis has 4 rows",
        ),
        (
            lambda d: d["tensor_metadata"].update(data={"shape": (2, 3, 8), "dtype": torch.float32}),
            "int64 or int32",
        ),
    ],
)
def test_description_errors_name_the_problem(
    change: Callable[[dict[str, Any]], object], message: str
) -> None:
    description = _ct_description()
    change(description)
    with pytest.raises(FheliumValueError, match=message):
        validate_value_description(**description)


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_every_core_type_is_one_codec_in_the_registry(value: object) -> None:
    name = type(value).__name__
    codec = value_codec(name)
    assert codec is not None and codec.name == name and codec.cls is type(value) is VALUE_TYPES[name]
    assert codec.secret == isinstance(value, SecretKey)
    assert value_type_extension(name) is None  # a core type, not an extension
    metadata, tensors = codec.describe(value)
    assert set(metadata) == set(codec.metadata_fields) and tuple(tensors) == codec.tensor_names(metadata)
    codec.validate(metadata, None)
    assert type(codec.build(metadata, tensors)) is type(value)


def test_core_type_names_are_reserved() -> None:
    codec = value_codec("Ciphertext")
    assert codec is not None
    with pytest.raises(FheliumValueError, match="'Ciphertext' is already registered"):
        register_value_type(codec)
    with pytest.raises(FheliumValueError, match="already registered"):
        register_value_type(
            ValueCodec(
                "Ciphertext", dict, (), lambda m: (), lambda m, t: None, lambda v: ({}, {}), lambda m, t: {}
            )
        )


def test_an_unhashable_value_type_is_refused_as_a_value_error() -> None:
    description = _ct_description()
    description["value_type"] = ["Ciphertext"]
    with pytest.raises(FheliumValueError, match=r"Unsupported value envelope value_type: \['Ciphertext'\]"):
        validate_value_description(**description)
