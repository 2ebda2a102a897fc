"""The opt-in torch.compile path: same bits as eager, one graph for every shape."""

from __future__ import annotations

import pytest
import torch

from fhelium.engine import CkksEngine, KeySet, Preset
from fhelium.engine.compiled import COMPILE_ENVIRONMENT_VARIABLE, compile_requested


def test_compile_is_opt_in_through_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMPILE_ENVIRONMENT_VARIABLE, raising=False)
    assert compile_requested(None) is False
    assert compile_requested(True) is True
    monkeypatch.setenv(COMPILE_ENVIRONMENT_VARIABLE, "1")
    assert compile_requested(None) is True
    assert compile_requested(False) is False
    assert CkksEngine(Preset.TOY_N1024).ntt.compiled is True
    monkeypatch.setenv(COMPILE_ENVIRONMENT_VARIABLE, "0")
    assert CkksEngine(Preset.TOY_N1024).ntt.compiled is False


@pytest.mark.slow
def test_compiled_engine_matches_eager_bit_for_bit(toy_engine: CkksEngine, toy_keys: KeySet) -> None:
    compiled = CkksEngine(Preset.TOY_N1024, compile_kernels=True)
    assert compiled.ntt.compiled and not toy_engine.ntt.compiled
    generator = torch.Generator().manual_seed(7)
    for batch in [(), (3,), (2, 2)]:  # several ranks and sizes: shape-generic graphs must serve all
        x = torch.rand(*batch, toy_engine.slot_count, generator=generator, dtype=torch.float64) * 2 - 1
        ct = toy_engine.encode_encrypt(x, toy_keys.public)
        eager_product = toy_engine.rescale(
            toy_engine.relinearize(toy_engine.multiply(ct, ct), toy_keys.relin())
        )
        compiled_product = compiled.rescale(compiled.relinearize(compiled.multiply(ct, ct), toy_keys.relin()))
        assert torch.equal(compiled_product.data, eager_product.data)
        rotated = compiled.rotate(ct, toy_keys.rotation(1))
        assert torch.equal(rotated.data, toy_engine.rotate(ct, toy_keys.rotation(1)).data)
        expected = torch.roll(x, 1, dims=-1)  # the engine rotates like torch.roll
        assert float((toy_engine.decrypt_decode(rotated, toy_keys.secret) - expected).abs().max()) < 1e-3
    fresh = compiled.encode_encrypt(x, toy_keys.public)
    assert float((compiled.decrypt_decode(fresh, toy_keys.secret) - x).abs().max()) < 1e-3
