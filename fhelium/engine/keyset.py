"""A bundle of the keys one party generates, for convenience in tests, examples and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from fhelium.core import (
    ConjugationKey,
    MissingKeyError,
    PublicKey,
    RelinearizationKey,
    RotationKey,
    SecretKey,
)


@dataclass
class KeySet:
    secret: SecretKey
    public: PublicKey
    relinearization: RelinearizationKey | None = None
    rotations: dict[int, RotationKey] = field(default_factory=dict)
    conjugation: ConjugationKey | None = None

    def rotation(self, step: int) -> RotationKey:
        try:
            return self.rotations[step]
        except KeyError:
            raise MissingKeyError(
                f"no rotation key for step {step}; generated steps: {sorted(self.rotations)} "
                "(pass rotation_steps=[...] to CkksEngine.generate_keys)"
            ) from None

    def relin(self) -> RelinearizationKey:
        if self.relinearization is None:
            raise MissingKeyError("no relinearization key; generate_keys(relinearization=True) makes one")
        return self.relinearization
