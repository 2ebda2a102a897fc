"""FLODL_NET_TIMEOUT_SCALE: one knob that stretches (slow WAN) or shrinks (test rigs) every net deadline."""

from __future__ import annotations

import math
import os
from typing import Final

TIMEOUT_SCALE_ENV: Final = "FLODL_NET_TIMEOUT_SCALE"
MIN_TIMEOUT_SCALE: Final = 0.1


class TimeoutScaleError(ValueError):
    """FLODL_NET_TIMEOUT_SCALE is set to something unusable; the message says what and how to fix it."""


def timeout_scale() -> float:
    """The scale factor from the environment (1.0 when unset or empty)."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise TimeoutScaleError(
            f"{TIMEOUT_SCALE_ENV}={raw!r} is not a number; expected a scale factor >= {MIN_TIMEOUT_SCALE} "
            "(e.g. 3 for a slow WAN link, 0.5 for a fast-failing test rig)"
        ) from None
    if not math.isfinite(value) or value < MIN_TIMEOUT_SCALE:
        raise TimeoutScaleError(
            f"{TIMEOUT_SCALE_ENV}={raw!r} is out of range; expected a finite scale factor >= "
            f"{MIN_TIMEOUT_SCALE}"
        )
    return value


def scaled(seconds: float) -> float:
    """`seconds` stretched by the timeout scale."""
    return seconds * timeout_scale()
