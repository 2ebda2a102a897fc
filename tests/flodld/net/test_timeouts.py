"""FLODL_NET_TIMEOUT_SCALE parsing."""

from __future__ import annotations

import pytest

from flodld.net import TimeoutScaleError, scaled, timeout_scale


def test_unset_and_empty_mean_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE", raising=False)
    assert timeout_scale() == 1.0
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "  ")
    assert timeout_scale() == 1.0


@pytest.mark.parametrize(("raw", "scale"), [("3", 3.0), ("0.1", 0.1), (" 0.5 ", 0.5), ("1e1", 10.0)])
def test_valid_scales_stretch_deadlines(monkeypatch: pytest.MonkeyPatch, raw: str, scale: float) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", raw)
    assert timeout_scale() == scale
    assert scaled(30.0) == pytest.approx(30.0 * scale)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("fast", "is not a number"),
        ("0.09", "out of range"),
        ("-1", "out of range"),
        ("nan", "finite"),
        ("inf", "finite"),
    ],
)
def test_invalid_scales_name_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, raw: str, fragment: str
) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", raw)
    with pytest.raises(TimeoutScaleError, match=fragment) as caught:
        timeout_scale()
    assert f"FLODL_NET_TIMEOUT_SCALE={raw!r}" in str(caught.value) and ">= 0.1" in str(caught.value)
