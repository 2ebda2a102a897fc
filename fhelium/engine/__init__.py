"""fhelium CKKS engine: parameters, keys, encoding, encryption and homomorphic operations."""

from __future__ import annotations

from fhelium.engine.engine import CkksEngine
from fhelium.engine.keyset import KeySet
from fhelium.engine.parameters import MAX_MODULUS_BITS_128, CkksParameters, Preset, preset_parameters
from fhelium.engine.sampling import RandomSource

Engine = CkksEngine

__all__ = [
    "MAX_MODULUS_BITS_128",
    "CkksEngine",
    "CkksParameters",
    "Engine",
    "KeySet",
    "Preset",
    "RandomSource",
    "preset_parameters",
]
