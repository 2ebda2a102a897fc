"""Binding a torch.device as the `!fhelium_memory.device` resource."""

from __future__ import annotations

import torch

from fhelium.backend.resources import BoundResource

DEVICE_RESOURCE_KIND = "execution-device"


def bind_device(symbol: str, device: torch.device | str) -> BoundResource:
    """Bind `device` (e.g. "cpu", "cuda:0"); CUDA targets need a concrete index."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        raise ValueError(
            f"device resource {symbol!r} must name a concrete CUDA index (e.g. cuda:0), got {device}"
        )
    return BoundResource(symbol, DEVICE_RESOURCE_KIND, target)
