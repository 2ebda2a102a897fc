from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fhelium.core import Ciphertext, FheliumValueError, ParameterMismatchError, RotationKey, SeededCiphertext
from fhelium.engine import CkksEngine, KeySet, Preset
from fhelium.serialization import (
    inspect_bytes,
    inspect_value,
    load_value,
    save_value,
    value_from_bytes,
    value_to_bytes,
)

# Edits a value blob's manifest and safetensors header in place.
Change = Callable[[dict[str, Any], dict[str, Any]], object]


@pytest.fixture(scope="module")
def engine() -> CkksEngine:
    torch.set_num_threads(1)
    return CkksEngine(Preset.TOY_N1024, rng_seed=77)


@pytest.fixture(scope="module")
def keys(engine: CkksEngine) -> KeySet:
    return engine.generate_keys(rotation_steps=(2,))


def test_ciphertext_bytes_round_trip_decrypts(engine: CkksEngine, keys: KeySet) -> None:
    x = torch.linspace(-1, 1, engine.slot_count, dtype=torch.float64)
    ct = engine.encode_encrypt(x, keys.public)
    blob = value_to_bytes(ct, engine=engine)
    loaded = value_from_bytes(blob, engine=engine, expected_type="Ciphertext")
    assert isinstance(loaded, Ciphertext) and torch.equal(loaded.data, ct.data)
    assert (loaded.depth, loaded.scale, loaded.prime_ids) == (ct.depth, ct.scale, ct.prime_ids)
    assert float((engine.decrypt_decode(loaded, keys.secret).real - x).abs().max()) < 1e-3
    assert inspect_bytes(blob)["value_type"] == "Ciphertext"


def test_file_round_trip_keys_and_permissions(engine: CkksEngine, keys: KeySet, tmp_path: Path) -> None:
    path = save_value(keys.rotation(2), tmp_path / "rot.safetensors", engine=engine)
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = load_value(path, engine=engine)
    assert isinstance(loaded, RotationKey) and loaded.rotation_step == 2
    assert inspect_value(path)["value_metadata"]["rotation_step"] == 2
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_value(keys.rotation(2), path)
    with pytest.raises(PermissionError, match="allow_secret=True"):
        save_value(keys.secret, tmp_path / "sk.safetensors")
    save_value(keys.secret, tmp_path / "sk.safetensors", allow_secret=True)


def test_seeded_ciphertext_is_about_half_size_and_expands(engine: CkksEngine, keys: KeySet) -> None:
    x = torch.linspace(-1, 1, engine.slot_count, dtype=torch.float64)
    seeded = engine.encrypt_seeded(engine.encode(x), keys.secret)
    full = engine.expand_seeded(seeded)
    assert float((engine.decrypt_decode(full, keys.secret).real - x).abs().max()) < 1e-3
    seeded_blob, full_blob = value_to_bytes(seeded, engine=engine), value_to_bytes(full, engine=engine)
    assert len(seeded_blob) < 0.55 * len(full_blob)
    reloaded = value_from_bytes(seeded_blob, engine=engine)
    assert isinstance(reloaded, SeededCiphertext)
    assert torch.equal(engine.expand_seeded(reloaded).data, full.data)


def test_loading_checks_engine_parameters(engine: CkksEngine, keys: KeySet) -> None:
    ct = engine.encode_encrypt(torch.zeros(4), keys.public)
    blob = value_to_bytes(ct, engine=engine)
    other = CkksEngine(Preset.TOY_N2048, rng_seed=1)
    with pytest.raises(ParameterMismatchError, match="ring dimension 1024; the engine uses N=2048"):
        value_from_bytes(blob, engine=other)
    bad = ct.with_data(ct.data.clone())
    bad.data[0, 0, 0] = engine.moduli[0]
    with pytest.raises(ParameterMismatchError, match=r"outside \[0, q\)"):
        value_from_bytes(value_to_bytes(bad), engine=engine)
    with pytest.raises(FheliumValueError, match="expected a serialized PublicKey; got Ciphertext"):
        value_from_bytes(blob, expected_type="PublicKey")


def _rewrite_manifest(blob: bytes, change: Change) -> bytes:
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    manifest = json.loads(header["__metadata__"]["fhelium.manifest"])
    change(manifest, header)
    header["__metadata__"]["fhelium.manifest"] = json.dumps(manifest)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + blob[8 + size :]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m, h: m.update(value_schema_version=5), "Unsupported value envelope schema version: 5"),
        (lambda m, h: m["value_metadata"].update(prime_ids=[1, 1, 2]), "strictly increasing"),
        (lambda m, h: m["value_metadata"].pop("depth"), "missing fields"),
        (lambda m, h: h["__metadata__"].update({"fhelium.format": "x"}), "not an fhelium value"),
        (lambda m, h: m.update(tensor_names=["c0"]), "lacks a usable entry for tensor 'c0'"),
    ],
)
def test_bad_headers_are_refused_before_payload(
    engine: CkksEngine, keys: KeySet, change: Change, message: str
) -> None:
    blob = value_to_bytes(engine.encode_encrypt(torch.zeros(4), keys.public))
    with pytest.raises(FheliumValueError, match=message):
        value_from_bytes(_rewrite_manifest(blob, change))


def test_truncated_and_oversized_headers() -> None:
    with pytest.raises(FheliumValueError, match="truncated"):
        value_from_bytes(b"abc")
    with pytest.raises(FheliumValueError, match="header claims"):
        value_from_bytes(struct.pack("<Q", 1 << 40) + b"{}")


def test_slot_plaintexts_round_trip_including_complex_messages() -> None:
    from fhelium.core import Plaintext

    for message in (torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.complex128)):
        loaded = value_from_bytes(value_to_bytes(Plaintext(message, 0, 2.0**20)))
        assert isinstance(loaded, Plaintext) and loaded.message is not None
        assert loaded.message.dtype == message.dtype and torch.equal(loaded.message, message)
