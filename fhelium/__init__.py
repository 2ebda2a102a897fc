"""fhelium: CKKS homomorphic encryption on pure torch.

The value model lives in ``fhelium.core``, arithmetic in ``fhelium.engine``, files and bytes in
``fhelium.serialization``; collectives over ciphertexts in ``fhelium.distributed``.
"""

from __future__ import annotations

import fhelium.multiparty.values  # noqa: F401  registers the share value types with fhelium.serialization
from fhelium.core import Ciphertext, Plaintext, PublicKey, SecretKey
from fhelium.engine import CkksEngine, CkksParameters, Preset

__all__ = ["Ciphertext", "CkksEngine", "CkksParameters", "Plaintext", "Preset", "PublicKey", "SecretKey"]
