"""fhelium.multiparty: threshold CKKS — collective keys and collective decryption.

No party holds the secret key: each holds a share s_i, the public key is built jointly from a
common seed no single party chooses, and decryption needs every party's decryption share
(N-out-of-N), or any t of them with t-out-of-N keys (``shamir``, ``dealing``, ``dropout``).
See docs/fhelium-multiparty.md.
"""

from __future__ import annotations

from fhelium.multiparty.parameters import (
    THRESHOLD_AGGREGATION,
    THRESHOLD_CKKS_PARAMETERS,
    ThresholdParameters,
    aggregate_noise_l2_bound,
    expected_max_mean_error,
    fresh_noise_variance,
    required_smudging_sigma,
)
from fhelium.multiparty.protocol import (
    FloodingBudgetError,
    MissingSharesError,
    MultipartyError,
    SeedCommitmentError,
    ThresholdParty,
    ciphertext_digest,
    combine_decryption,
    combine_public_key,
    combine_seed,
    commitment_digest,
    common_uniform,
    decode_contributions,
    encode_values,
    encrypt_values,
    smudging_noise,
)
from fhelium.multiparty.values import (
    DecryptionShare,
    PublicKeyShare,
    SecretKeyShare,
    SeedCommitment,
    SeedReveal,
)

__all__ = [
    "THRESHOLD_AGGREGATION",
    "THRESHOLD_CKKS_PARAMETERS",
    "DecryptionShare",
    "FloodingBudgetError",
    "MissingSharesError",
    "MultipartyError",
    "PublicKeyShare",
    "SecretKeyShare",
    "SeedCommitment",
    "SeedCommitmentError",
    "SeedReveal",
    "ThresholdParameters",
    "ThresholdParty",
    "aggregate_noise_l2_bound",
    "ciphertext_digest",
    "combine_decryption",
    "combine_public_key",
    "combine_seed",
    "commitment_digest",
    "common_uniform",
    "decode_contributions",
    "encode_values",
    "encrypt_values",
    "expected_max_mean_error",
    "fresh_noise_variance",
    "required_smudging_sigma",
    "smudging_noise",
]
