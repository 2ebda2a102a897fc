"""Randomness for keys and encryption: a ChaCha20 keystream, expanded into torch tensors.

Why ChaCha20: it is a cryptographically secure stream cipher (RFC 8439), fast in the
``cryptography`` package (already a dependency through asyncssh), and deterministic from a
32-byte seed, which gives both seedable tests and seed-compressed ciphertexts (the uniform
component is re-expanded from its seed). Without an explicit seed, the key comes from
``secrets.token_bytes`` (the OS CSPRNG).

Stream layout (expansion version 2, see ``EXPANSION_VERSION``):

- ``cryptography``'s 16-byte ChaCha20 "nonce" is RFC 8439's 32-bit little-endian block
  counter followed by the 96-bit nonce. :func:`chacha20_keystream` takes the two separately.
- Every *purpose* a seed serves (the secret key, the uniform ``a`` of keys, errors, the
  ephemeral ``u`` of encryption, seeded-ciphertext expansion, ...) gets its own ChaCha20 key,
  ``BLAKE2b(key=seed, person="fhelium.rng.v2", data=purpose)``, so streams of different
  purposes are independent even under one seed.
- Within one purpose, draw ``i`` uses the 96-bit nonce ``i`` (little-endian) with the block
  counter starting at 0, and one draw may use at most 2^32 blocks (256 GiB), so no two draws
  ever share a keystream block.

Version 1 (before fhelium issue 13) put the draw index into the block counter, so draw n+1
was draw n shifted by 64 bytes and a public key's ``a`` published the bytes its secret key was
sampled from. Keys made with version 1 must be treated as compromised.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from typing import Literal

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
EXPANSION_VERSION = 2
CHACHA20_BLOCK_BYTES = 64
CHACHA20_NONCE_BYTES = 12
MAX_BLOCKS_PER_DRAW = 1 << 32  # the RFC 8439 block counter is 32 bits wide
_PERSONALIZATION = b"fhelium.rng.v2"

Purpose = Literal[
    "general",  # a RandomSource used directly (tests, tools)
    "secret",  # ternary secret key
    "uniform",  # the uniform 'a' of public and key-switching keys
    "error",  # Gaussian errors of keys and encryptions
    "ephemeral",  # the ternary 'u' of public-key encryption
    "seeded_uniform",  # c1 of a seeded ciphertext, expanded from its (public) seed
    "seed_contribution",  # a party's secret 32-byte contribution to a multiparty common seed
    "common_uniform",  # the common 'a' of a collective public key, expanded from the joint (public) seed
    "smudging",  # noise-flooding noise of multiparty decryption shares
    "share",  # the random coefficients of a t-out-of-N (Shamir) sharing of a secret share
]
PURPOSES: tuple[str, ...] = (
    "general", "secret", "uniform", "error", "ephemeral", "seeded_uniform",
    "seed_contribution", "common_uniform", "smudging", "share",
)


def chacha20_keystream(key: bytes, counter: int, nonce: bytes, nbytes: int) -> bytes:
    """``nbytes`` of raw ChaCha20 keystream (RFC 8439: 32-bit block counter, 96-bit nonce)."""
    if len(key) != 32:
        raise ValueError(f"ChaCha20 key must be 32 bytes; got {len(key)}")
    if len(nonce) != CHACHA20_NONCE_BYTES:
        raise ValueError(f"ChaCha20 nonce must be {CHACHA20_NONCE_BYTES} bytes; got {len(nonce)}")
    if type(counter) is not int or not 0 <= counter < MAX_BLOCKS_PER_DRAW:
        raise ValueError(f"ChaCha20 block counter must be in [0, 2^32); got {counter!r}")
    if nbytes < 0:
        raise ValueError(f"keystream length must be >= 0; got {nbytes}")
    blocks = -(-nbytes // CHACHA20_BLOCK_BYTES)
    if counter + blocks > MAX_BLOCKS_PER_DRAW:
        # The counter would wrap (or carry into the nonce) and repeat keystream.
        raise ValueError(
            f"a keystream of {nbytes} bytes from block {counter} would overflow the 32-bit ChaCha20 "
            f"block counter (at most {MAX_BLOCKS_PER_DRAW * CHACHA20_BLOCK_BYTES} bytes per draw)"
        )
    cipher = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), mode=None)
    return cipher.encryptor().update(bytes(nbytes))


def purpose_key(seed: bytes, purpose: str) -> bytes:
    """The ChaCha20 key of one purpose under ``seed`` (domain separation by label)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown randomness purpose {purpose!r}; expected one of {list(PURPOSES)}")
    return hashlib.blake2b(purpose.encode(), digest_size=32, key=seed, person=_PERSONALIZATION).digest()


def _keystream(key: bytes, draw: int, nbytes: int) -> bytes:
    """Draw number ``draw`` of one purpose's stream: nonce = draw index, counter from 0."""
    return chacha20_keystream(key, 0, draw.to_bytes(CHACHA20_NONCE_BYTES, "little"), nbytes)


def _broadcast(left: tuple[int, ...], right: tuple[int, ...]) -> tuple[int, ...]:
    width = max(len(left), len(right))
    padded = [(1,) * (width - len(x)) + x for x in (left, right)]
    return tuple(max(a, b) for a, b in zip(*padded, strict=True))


class RandomSource:
    """A seeded stream of uniform words for one purpose; each draw consumes a new nonce.

    ``stream(purpose)`` returns the (cached) source of another purpose under the same seed;
    the engine draws every secret, uniform, error and ephemeral value through its own purpose.
    """

    def __init__(self, seed: bytes | int | None = None, *, purpose: Purpose = "general") -> None:
        if seed is None:
            seed = secrets.token_bytes(SEED_BYTES)
        elif isinstance(seed, int):
            seed = seed.to_bytes(SEED_BYTES, "little")
        if len(seed) != SEED_BYTES:
            raise ValueError(f"RandomSource seed must be {SEED_BYTES} bytes; got {len(seed)}")
        self.seed = seed
        self.purpose = purpose
        self._key = purpose_key(seed, purpose)
        self._nonce = 0
        self._streams: dict[str, RandomSource] = {purpose: self}

    def stream(self, purpose: Purpose) -> RandomSource:
        """The source of ``purpose`` under this seed (one object per purpose, so draws never repeat)."""
        source = self._streams.get(purpose)
        if source is None:
            source = RandomSource(self.seed, purpose=purpose)
            source._streams = self._streams
            self._streams[purpose] = source
        return source

    def _bytes(self, count: int) -> bytearray:
        data = bytearray(_keystream(self._key, self._nonce, count))
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


__all__ = [
    "EXPANSION_VERSION",
    "PURPOSES",
    "SEED_BYTES",
    "Purpose",
    "RandomSource",
    "chacha20_keystream",
    "purpose_key",
]
