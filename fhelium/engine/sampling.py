"""Randomness for keys and encryption: a ChaCha20 keystream, expanded into torch tensors.

Why ChaCha20: it is a cryptographically secure stream cipher (RFC 8439), fast in the
``cryptography`` package (already a dependency through asyncssh), and deterministic from a
32-byte seed, which gives both seedable tests and seed-compressed ciphertexts (the uniform
component is re-expanded from its seed). Without an explicit seed, the key comes from
``secrets.token_bytes`` (the OS CSPRNG). Every draw uses a fresh 128-bit counter block (nonce),
so no keystream is ever reused under one key.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32


def _keystream(seed: bytes, nonce: int, nbytes: int) -> bytes:
    cipher = Cipher(algorithms.ChaCha20(seed, nonce.to_bytes(16, "little")), mode=None)
    return cipher.encryptor().update(bytes(nbytes))


def _broadcast(left: tuple[int, ...], right: tuple[int, ...]) -> tuple[int, ...]:
    width = max(len(left), len(right))
    padded = [(1,) * (width - len(x)) + x for x in (left, right)]
    return tuple(max(a, b) for a, b in zip(*padded, strict=True))


class RandomSource:
    """A seeded stream of uniform words; each ``words`` call consumes a new nonce."""

    def __init__(self, seed: bytes | int | None = None) -> None:
        if seed is None:
            seed = secrets.token_bytes(SEED_BYTES)
        elif isinstance(seed, int):
            seed = seed.to_bytes(SEED_BYTES, "little")
        if len(seed) != SEED_BYTES:
            raise ValueError(f"RandomSource seed must be {SEED_BYTES} bytes; got {len(seed)}")
        self.seed = seed
        self._nonce = 0

    def _bytes(self, count: int) -> bytearray:
        data = bytearray(_keystream(self.seed, self._nonce, count))
        self._nonce += 1
        return data

    def words(self, count: int) -> torch.Tensor:
        """``count`` uniform 63-bit non-negative int64 values."""
        return torch.frombuffer(self._bytes(8 * count), dtype=torch.int64).bitwise_and_((1 << 63) - 1)

    def uniform_below(self, bounds: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Uniform integers in ``[0, bound)`` by masking and rejection; ``bounds`` broadcasts to shape."""
        bits = torch.tensor(
            [max(1, int(b).bit_length()) for b in bounds.flatten().tolist()], dtype=torch.int64
        ).reshape(bounds.shape)
        masks = (torch.ones_like(bits) << bits) - 1
        full = _broadcast(tuple(shape), tuple(bounds.shape))
        bound_full = bounds.expand(full)
        mask_full = masks.expand(full)
        values = self.words(math.prod(full)).reshape(full) & mask_full
        rejected = values >= bound_full
        while bool(rejected.any()):
            count = int(rejected.sum())
            fresh = self.words(count) & mask_full[rejected]
            values[rejected] = fresh
            rejected = values >= bound_full
        return values

    def ternary(self, shape: Sequence[int]) -> torch.Tensor:
        """Uniform values in {-1, 0, 1}: one keystream byte each, bytes of 255 rejected.

        255 = 3 * 85, so ``byte % 3`` is uniform over the accepted bytes; a rejection costs one
        byte in 256 (the general ``uniform_below`` spends 8 bytes per draw and rejects 1 in 4).
        """
        count = math.prod(shape)
        result = torch.empty(count, dtype=torch.int64)
        filled = 0
        while filled < count:
            missing = count - filled
            raw = torch.frombuffer(self._bytes(missing + missing // 128 + 64), dtype=torch.uint8)
            accepted = raw[raw < 255][:missing]
            result[filled : filled + accepted.numel()] = accepted.long() % 3 - 1
            filled += accepted.numel()
        return result.reshape(tuple(shape))

    def gaussian(self, shape: Sequence[int], sigma: float) -> torch.Tensor:
        """Rounded normal samples (Box–Muller on 53-bit uniforms), resampled beyond 6σ."""
        count = math.prod(shape)
        result = self._normal(count, sigma)
        bound = 6.0 * sigma
        outliers = result.abs() > bound
        while bool(outliers.any()):
            result[outliers] = self._normal(int(outliers.sum()), sigma)
            outliers = result.abs() > bound
        return result.round().long().reshape(tuple(shape))

    def _normal(self, count: int, sigma: float) -> torch.Tensor:
        half = (count + 1) // 2
        raw = self.words(2 * half) >> 10  # 53-bit integers
        uniform = (raw.double() + 0.5) * 2.0**-53  # (0, 1), never 0
        u1, u2 = uniform[:half], uniform[half:]
        radius = torch.sqrt(-2.0 * torch.log(u1)) * sigma
        angle = 2.0 * math.pi * u2
        return torch.cat((radius * torch.cos(angle), radius * torch.sin(angle)))[:count]


__all__ = ["SEED_BYTES", "RandomSource"]
