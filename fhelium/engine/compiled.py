"""Opt-in ``torch.compile`` of the engine's hot elementwise kernels (eager stays the default).

Each kernel is compiled once per process and traced shape-generically, so one graph serves
every row count, batch size and stride: sizes are ``backed_size_oblivious`` (no separate
graphs for sizes 0/1), duck sizing is off, and inputs are passed detached and at storage
offset 0 so that "is this a view" and "where does it start" do not become guards. Those
options only matter while tracing, so they are entered on the first call only (entering them
costs ~30 µs, a noticeable share of a 14-stage NTT). A later recompile (new dtype or device)
is still correct, merely specialised. Measurements: docs/fhelium-performance.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

COMPILE_ENVIRONMENT_VARIABLE = "FHELIUM_COMPILE"


def compile_requested(explicit: bool | None) -> bool:
    """``explicit`` if given, else whether ``FHELIUM_COMPILE=1`` is set in the environment."""
    return os.environ.get(COMPILE_ENVIRONMENT_VARIABLE) == "1" if explicit is None else explicit


def _plain(argument: object) -> object:
    """A tensor detached and at storage offset 0 (a copy when it starts later); anything else as is."""
    if not isinstance(argument, torch.Tensor):
        return argument
    return argument.detach() if argument.storage_offset() == 0 else argument.clone()


def compile_kernel(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``kernel`` through ``torch.compile`` with the shape-generic tracing described above."""
    import torch.fx.experimental._config as fx_config  # imported here: only the opt-in path needs it

    compiled = torch.compile(kernel, dynamic=True)
    traced = False

    def run(*arguments: object) -> torch.Tensor:
        nonlocal traced
        plain = [_plain(argument) for argument in arguments]
        if traced:
            result: torch.Tensor = compiled(*plain)
            return result
        # patch is installed on config modules at import time, invisible to mypy
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):  # type: ignore[attr-defined]
            result = compiled(*plain)
        traced = True
        return result

    return run
