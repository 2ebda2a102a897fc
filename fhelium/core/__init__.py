"""fhelium value model: ciphertexts, plaintexts, keys and their state axes (no arithmetic here)."""

from __future__ import annotations

from fhelium.core.ciphertext import Ciphertext
from fhelium.core.compressed import COMPRESSED_PLAINTEXT_FORMAT_VERSION, CompressedPlaintext
from fhelium.core.errors import (
    DepthMismatchError,
    FheliumValueError,
    MaximumDepthError,
    MissingKeyError,
    ParameterMismatchError,
    PrimeMismatchError,
    ScaleMismatchError,
    ShapeMismatchError,
    ValueStateError,
)
from fhelium.core.keys import (
    KEY_TYPES,
    AnyKey,
    ConjugationKey,
    DenseKey,
    KeySwitchKey,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
    canonical_rotation_step,
)
from fhelium.core.plaintext import Plaintext
from fhelium.core.resident import TensorResident
from fhelium.core.seeded import SeededCiphertext
from fhelium.core.state import (
    CompressedPlaintextLayout,
    ModulusBasis,
    PlaintextRepresentation,
    PolynomialDomain,
    ResidueRepresentation,
)

__all__ = [
    "COMPRESSED_PLAINTEXT_FORMAT_VERSION",
    "KEY_TYPES",
    "AnyKey",
    "Ciphertext",
    "CompressedPlaintext",
    "CompressedPlaintextLayout",
    "ConjugationKey",
    "DenseKey",
    "DepthMismatchError",
    "FheliumValueError",
    "KeySwitchKey",
    "MaximumDepthError",
    "MissingKeyError",
    "ModulusBasis",
    "ParameterMismatchError",
    "Plaintext",
    "PlaintextRepresentation",
    "PolynomialDomain",
    "PrimeMismatchError",
    "PublicKey",
    "RelinearizationKey",
    "ResidueRepresentation",
    "RotationKey",
    "ScaleMismatchError",
    "SecretKey",
    "SeededCiphertext",
    "ShapeMismatchError",
    "TensorResident",
    "ValueStateError",
    "canonical_rotation_step",
]
