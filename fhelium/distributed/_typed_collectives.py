"""One place that gathers the typed (fhelium-specific) collectives for the public facade."""

from __future__ import annotations

from fhelium.distributed._ciphertext_reduction import (
    CiphertextAdder,
    ReductionTrace,
    all_reduce_ciphertext,
    reduce_ciphertext,
)
from fhelium.distributed._collective_common import CollectiveArgumentError, CollectiveFailure
from fhelium.distributed._limb_collectives import gather_ciphertext_limbs, scatter_ciphertext_limbs
from fhelium.distributed._transfer import TRANSFER_PROTOCOL_VERSION, DescriptorError
from fhelium.distributed._value_collectives import (
    all_gather_ciphertexts,
    all_gather_compressed_plaintexts,
    all_gather_plaintexts,
    broadcast_ciphertext,
    broadcast_compressed_plaintext,
    broadcast_key,
    broadcast_plaintext,
    gather_ciphertexts,
    scatter_ciphertexts,
)

TYPED_COLLECTIVES = (
    "broadcast_ciphertext",
    "broadcast_plaintext",
    "broadcast_compressed_plaintext",
    "broadcast_key",
    "scatter_ciphertexts",
    "gather_ciphertexts",
    "all_gather_ciphertexts",
    "all_gather_plaintexts",
    "all_gather_compressed_plaintexts",
    "scatter_ciphertext_limbs",
    "gather_ciphertext_limbs",
    "reduce_ciphertext",
    "all_reduce_ciphertext",
)

__all__ = [
    "TRANSFER_PROTOCOL_VERSION",
    "CiphertextAdder",
    "CollectiveArgumentError",
    "CollectiveFailure",
    "DescriptorError",
    "ReductionTrace",
    "all_gather_ciphertexts",
    "all_gather_compressed_plaintexts",
    "all_gather_plaintexts",
    "all_reduce_ciphertext",
    "broadcast_ciphertext",
    "broadcast_compressed_plaintext",
    "broadcast_key",
    "broadcast_plaintext",
    "gather_ciphertext_limbs",
    "gather_ciphertexts",
    "reduce_ciphertext",
    "scatter_ciphertext_limbs",
    "scatter_ciphertexts",
]
