"""EngineOperations: `EngineBase` plus the signatures of the operations `CkksEngine` binds.

The operation modules (keygen, encryption, evaluation, keyswitch, kernels) type their first parameter
with this class, so they call each other through the engine (``engine.rescale(...)``) without
importing engine.py, which imports them. The signatures are declared for the type checker only; at
run time the class adds nothing to `EngineBase`, and `CkksEngine` (engine.py) binds the functions
themselves. An operation another module calls through the engine is declared here, with its
function's signature less the engine (mypy checks each binding in `CkksEngine` against it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fhelium.engine.base import EngineBase

if TYPE_CHECKING:
    import torch

    from fhelium.core import (
        Ciphertext,
        ConjugationKey,
        KeySwitchKey,
        Plaintext,
        PolynomialDomain,
        PublicKey,
        RelinearizationKey,
        RotationKey,
        SecretKey,
    )


class EngineOperations(EngineBase):
    """The engine as its operations see it: state and checks (`EngineBase`) and the operations they share."""

    if TYPE_CHECKING:
        # keygen.py
        def generate_secret_key(self) -> SecretKey: ...
        def generate_public_key(self, secret: SecretKey) -> PublicKey: ...
        def generate_relinearization_key(self, secret: SecretKey) -> RelinearizationKey: ...
        def generate_rotation_key(self, secret: SecretKey, step: int) -> RotationKey: ...
        def generate_conjugation_key(self, secret: SecretKey) -> ConjugationKey: ...
        def _check_secret(self, secret: object) -> SecretKey: ...
        def _error_ntt(self, shape: Sequence[int], prime_ids: Sequence[int]) -> torch.Tensor: ...
        def _key_switch_key_data(self, secret: SecretKey, source: torch.Tensor) -> torch.Tensor: ...
        # encryption.py
        def encode(
            self,
            values: torch.Tensor | Sequence[complex] | float,
            *,
            depth: int = 0,
            scale: float | None = None,
            domain: PolynomialDomain = "ntt",
        ) -> Plaintext: ...
        def decode(self, plaintext: Plaintext) -> torch.Tensor: ...
        def encrypt(self, plaintext: Plaintext, public_key: PublicKey) -> Ciphertext: ...
        def encrypt_symmetric(
            self, plaintext: Plaintext, secret: SecretKey, *, seed: bytes | None = None
        ) -> Ciphertext: ...
        def uniform_from_seed(
            self, seed: bytes, prime_ids: Sequence[int], batch_shape: Sequence[int]
        ) -> torch.Tensor: ...
        def decrypt(self, ciphertext: Ciphertext, secret: SecretKey) -> Plaintext: ...
        # evaluation.py
        def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext: ...
        def multiply_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext: ...
        def _with_plain_in_c0(
            self, ct: Ciphertext, pt: Plaintext, operation: str, combine_: Callable[..., torch.Tensor]
        ) -> Ciphertext: ...
        def multiply(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext: ...
        def rescale(self, value: Ciphertext) -> Ciphertext: ...
        # keyswitch.py
        def relinearize(self, value: Ciphertext, key: RelinearizationKey) -> Ciphertext: ...
        def rotate(self, value: Ciphertext, key: RotationKey) -> Ciphertext: ...
        def _check_switch_key(self, key: KeySwitchKey) -> None: ...
        def _decompose(self, poly_ntt: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor: ...
        def _inner_product(
            self, lifted: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey
        ) -> torch.Tensor: ...
        def _key_switch(
            self, poly_ntt: torch.Tensor, ids: tuple[int, ...], key: KeySwitchKey
        ) -> torch.Tensor: ...
        def _galois_switch(
            self, value: Ciphertext, element: int, key: KeySwitchKey, operation: str
        ) -> Ciphertext: ...
        # kernels.py
        def _small_ntt(self, values: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor: ...
        def _reconstruct(self, residues: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor: ...
        def _mod_down(
            self,
            values: torch.Tensor,
            ids: tuple[int, ...],
            addend: torch.Tensor | None = None,
            divided: torch.Tensor | None = None,
        ) -> torch.Tensor: ...
        def _inverse_constants(
            self, value: int, ids: tuple[int, ...]
        ) -> tuple[torch.Tensor, torch.Tensor]: ...


__all__ = ["EngineOperations"]
