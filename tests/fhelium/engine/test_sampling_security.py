"""The keystream behind keys and encryption never repeats, and the public key hides the secret.

Regression tests of fhelium issue 13, point 1: the draw index used to land in ChaCha20's block
counter, so draw n+1 was draw n shifted by one 64-byte block and a public key's uniform ``a``
published the bytes its ternary secret was sampled from.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from typing import cast

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fhelium.core import FheliumValueError, SeededCiphertext
from fhelium.engine import CkksEngine, sampling
from fhelium.engine.parameters import Preset
from fhelium.engine.sampling import RandomSource
from fhelium.serialization import value_from_bytes, value_to_bytes

SEED = bytes(range(100, 132))


def _windows(data: bytes, width: int = 8) -> set[bytes]:
    return {data[i : i + width] for i in range(len(data) - width + 1)}


def _shared_windows(left: bytes, right: bytes) -> int:
    return len(_windows(left) & _windows(right))


# -- (a) consecutive draws ------------------------------------------------------------------


def test_consecutive_draws_share_no_8_byte_window() -> None:
    source = RandomSource(SEED)
    draws = [bytes(source._bytes(4096)) for _ in range(4)]
    for i, earlier in enumerate(draws):
        for later in draws[i + 1 :]:
            assert _shared_windows(earlier, later) == 0


def test_consecutive_word_draws_are_not_shifted_copies() -> None:
    source = RandomSource(SEED)
    first, second = source.words(64), source.words(64)
    # The old construction made second[:56] == first[8:] (one 64-byte block = 8 words).
    assert not torch.equal(first[8:], second[:56])
    assert len(set(first.tolist()) & set(second.tolist())) == 0


# -- (b) known answers ----------------------------------------------------------------------

RFC8439_KEY = bytes(range(32))
RFC8439_NONCE = bytes.fromhex("000000000000004a00000000")
RFC8439_PLAINTEXT = (
    b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
    b"sunscreen would be it."
)
RFC8439_CIPHERTEXT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)


def test_raw_keystream_matches_rfc8439_section_2_4_2() -> None:
    stream = sampling.chacha20_keystream(RFC8439_KEY, 1, RFC8439_NONCE, len(RFC8439_PLAINTEXT))
    assert bytes(p ^ k for p, k in zip(RFC8439_PLAINTEXT, stream, strict=True)) == RFC8439_CIPHERTEXT


def test_raw_keystream_matches_rfc8439_section_2_3_2_block() -> None:
    block = sampling.chacha20_keystream(RFC8439_KEY, 1, bytes.fromhex("000000090000004a00000000"), 64)
    assert block.hex() == (
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )


def test_keystream_refuses_a_draw_that_would_wrap_the_block_counter() -> None:
    key, nonce = bytes(32), bytes(12)
    assert len(sampling.chacha20_keystream(key, 2**32 - 1, nonce, 64)) == 64
    with pytest.raises(ValueError, match="overflow the 32-bit ChaCha20 block counter"):
        sampling.chacha20_keystream(key, 2**32 - 1, nonce, 65)
    with pytest.raises(ValueError, match="nonce must be 12 bytes"):
        sampling.chacha20_keystream(key, 0, bytes(16), 64)


def test_expansion_is_pinned() -> None:
    """A fixed seed gives fixed words: a change here breaks every seeded ciphertext on the wire."""
    source = RandomSource(SEED)
    assert source.stream("seeded_uniform").words(4).tolist() == PINNED_SEEDED_WORDS
    assert RandomSource(SEED, purpose="seeded_uniform").words(4).tolist() == PINNED_SEEDED_WORDS
    assert source.stream("secret").ternary((12,)).tolist() == PINNED_SECRET_TERNARY
    # The documented construction: purpose key = BLAKE2b(seed, "fhelium.rng.v2", purpose),
    # draw i = ChaCha20(purpose key, counter 0, nonce i).
    key = hashlib.blake2b(b"seeded_uniform", digest_size=32, key=SEED, person=b"fhelium.rng.v2").digest()
    raw = sampling.chacha20_keystream(key, 0, bytes(12), 32)
    words = [int.from_bytes(raw[8 * i : 8 * i + 8], "little") & (2**63 - 1) for i in range(4)]
    assert words == PINNED_SEEDED_WORDS


PINNED_SEEDED_WORDS = [3809256410760041625, 6770931333664961273, 8339302394871596826, 6543850801373546944]
PINNED_SECRET_TERNARY = [-1, 1, 1, 0, 0, 1, -1, 0, 0, 1, 0, 1]


# -- (c) the public key attack --------------------------------------------------------------


def _old_keystream(seed: bytes, nonce: int, nbytes: int) -> bytes:
    """The construction before the fix: the draw index lands in the 32-bit block counter."""
    cipher = Cipher(algorithms.ChaCha20(seed, nonce.to_bytes(16, "little")), mode=None)
    return cipher.encryptor().update(bytes(nbytes))


class OldRandomSource(RandomSource):
    """The pre-fix source: one stream for every purpose, draw n = counter n."""

    def __init__(self, seed: bytes) -> None:
        super().__init__(seed)
        self._old_draw = 0

    def stream(self, purpose: sampling.Purpose) -> RandomSource:
        return self

    def _bytes(self, count: int) -> bytearray:
        data = bytearray(_old_keystream(self.seed, self._old_draw, count))
        self._old_draw += 1
        return data


def _public_bytes(a_row: torch.Tensor, modulus: int) -> list[int | None]:
    """What ``pk.a``'s first limb shows of the words it was drawn from: the low bytes below the mask."""
    known = modulus.bit_length() // 8
    out: list[int | None] = []
    for word in a_row.tolist():
        out.extend((word >> (8 * k)) & 0xFF if k < known else None for k in range(8))
    return out


def _secret_sampling_bytes(raw: bytes, count: int) -> list[int]:
    """Stream offset of the byte each ternary coefficient came from (bytes of 255 are skipped)."""
    positions = [i for i, b in enumerate(raw) if b != 255]
    assert len(positions) >= count
    return positions[:count]


def _attack(make_engine: Callable[[], CkksEngine], monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Predict each secret coefficient from pk.a at every block offset; report the best offset.

    The test (as an oracle) records the secret's raw sampling bytes so that 255-rejections do not
    blur the measure: it asks how many coefficients follow from public bytes, not how clever an
    attacker must be to align them.
    """
    engine = make_engine()
    draws: list[bytes] = []
    cls = type(engine.random)
    original = cls._bytes

    def recording(self: RandomSource, count: int) -> bytearray:
        data = original(self, count)
        draws.append(bytes(data))
        return data

    monkeypatch.setattr(cls, "_bytes", recording)
    secret = engine.generate_secret_key()
    secret_draws = list(draws)
    public = engine.generate_public_key(secret)
    monkeypatch.setattr(cls, "_bytes", original)
    assert len(secret_draws) == 1, "the secret came from one draw"
    raw = secret_draws[0]

    n = engine.ring_degree
    q0 = engine.moduli[0]
    coefficients = engine.ntt.inverse(secret.data[:1].clone(), (0,))[0].tolist()
    s = [c - q0 if c > q0 // 2 else c for c in coefficients]
    assert set(s) <= {-1, 0, 1}
    positions = _secret_sampling_bytes(raw, n)
    assert [raw[p] % 3 - 1 for p in positions] == s  # the oracle is right about the sampling bytes

    visible = _public_bytes(public.data[1, 0].cpu(), q0)
    best: dict[str, float] = {"predicted": 0, "correct": 0, "rate": 0.0, "shift": 0}
    for shift in range(-4 * 64, 5 * 64, 64):  # pk.a's stream at ±4 blocks from the secret's
        predicted = correct = 0
        for coefficient, position in zip(s, positions, strict=True):
            index = position - shift
            if 0 <= index < len(visible) and visible[index] is not None and visible[index] != 255:
                predicted += 1
                correct += int(visible[index] % 3 - 1 == coefficient)  # type: ignore[operator]
        if correct > best["correct"]:
            best = {
                "predicted": predicted,
                "correct": correct,
                "rate": correct / max(predicted, 1),
                "shift": shift,
            }
    return best


@pytest.fixture(scope="module")
def default_engine_parameters() -> Preset:
    return Preset.SLOTS8192_SCALE40_DEPTH4


def test_public_key_reveals_nothing_about_the_secret_at_n_2_14(
    monkeypatch: pytest.MonkeyPatch, default_engine_parameters: Preset
) -> None:
    result = _attack(lambda: CkksEngine(default_engine_parameters, rng_seed=SEED), monkeypatch)
    # ~10,000 coefficients have a visible byte at any offset; a guess matches 1 in 3 of them.
    assert result["predicted"] > 8000
    assert 0.30 < result["rate"] < 0.37, result
    assert result["correct"] < 0.37 * 16384, result


def test_the_attack_recovers_the_secret_from_the_old_overlapping_keystream(
    monkeypatch: pytest.MonkeyPatch, default_engine_parameters: Preset
) -> None:
    """The same attack against a reimplementation of the old stream: it must find the leak."""

    def old_engine() -> CkksEngine:
        engine = CkksEngine(default_engine_parameters, rng_seed=SEED)
        engine.random = OldRandomSource(SEED)
        return engine

    result = _attack(old_engine, monkeypatch)
    assert result["correct"] > 10_000 and result["rate"] == 1.0 and result["shift"] == 64, result


# -- (d) purposes ---------------------------------------------------------------------------


def test_purposes_under_one_seed_share_no_8_byte_window() -> None:
    source = RandomSource(SEED)
    streams = {
        purpose: bytes(source.stream(cast(sampling.Purpose, purpose))._bytes(4096))
        for purpose in sampling.PURPOSES
    }
    names = sorted(streams)
    for i, left in enumerate(names):
        for right in names[i + 1 :]:
            assert _shared_windows(streams[left], streams[right]) == 0, (left, right)


def test_stream_of_a_purpose_is_one_object_so_its_draws_continue() -> None:
    source = RandomSource(SEED)
    first = source.stream("error").words(8)
    assert source.stream("error") is source.stream("error")
    assert not torch.equal(source.stream("error").words(8), first)
    assert source.stream("secret").stream("error") is source.stream("error")
    with pytest.raises(ValueError, match="unknown randomness purpose"):
        RandomSource(SEED, purpose="nonsense")  # type: ignore[arg-type]


# -- (e) seeded ciphertexts ------------------------------------------------------------------


def test_seeded_ciphertext_expands_identically_on_the_receiver() -> None:
    sender = CkksEngine(Preset.TOY_N1024, rng_seed=1)
    receiver = CkksEngine(Preset.TOY_N1024, rng_seed=2)  # other keystream state: expansion must not care
    keys = sender.generate_keys(relinearization=False)
    values = torch.linspace(-1, 1, sender.slot_count, dtype=torch.float64)
    seeded = sender.encrypt_seeded(sender.encode(values), keys.secret)
    received = value_from_bytes(value_to_bytes(seeded))
    assert isinstance(received, SeededCiphertext)
    expanded_there = receiver.expand_seeded(received)
    expanded_here = sender.expand_seeded(seeded)
    assert torch.equal(expanded_there.data, expanded_here.data)
    decoded = sender.decode(sender.decrypt(expanded_there, keys.secret)).real
    assert torch.allclose(decoded, values, atol=1e-3)


# -- (f) values made before the fix ----------------------------------------------------------


def _with_value_schema(blob: bytes, version: int) -> bytes:
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    manifest = json.loads(header["__metadata__"]["fhelium.manifest"])
    manifest["value_schema_version"] = version
    header["__metadata__"]["fhelium.manifest"] = json.dumps(manifest)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + blob[8 + size :]


def test_keys_and_seeded_ciphertexts_of_the_old_schema_are_refused_as_compromised() -> None:
    """Schema 1 public keys leak their secret and schema 1 seeds expand differently: refuse them."""
    engine = CkksEngine(Preset.TOY_N1024, rng_seed=3)
    keys = engine.generate_keys(relinearization=False)
    seeded = engine.encrypt_seeded(engine.encode(torch.zeros(4)), keys.secret)
    for value in (keys.public, seeded):
        blob = value_to_bytes(value)
        value_from_bytes(blob)  # the current schema loads
        with pytest.raises(FheliumValueError, match="must be treated as compromised"):
            value_from_bytes(_with_value_schema(blob, 1))
