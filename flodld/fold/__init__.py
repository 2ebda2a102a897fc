"""Sans-io folding of deposits: pluggable reductions and the round barrier that drives them.

Names are loaded on first use: the reductions need torch, the liveness table does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodld.fold.barrier import RoundBarrier, RoundError, RoundResult
    from flodld.fold.base import (
        Bundle,
        Fold,
        FoldError,
        MeanFold,
        ModularFold,
        SumFold,
        fold_from_spec,
        register_fold,
    )

_HOMES = {
    "RoundBarrier": "barrier", "RoundError": "barrier", "RoundResult": "barrier",
    "Bundle": "base", "Fold": "base", "FoldError": "base", "MeanFold": "base", "ModularFold": "base",
    "SumFold": "base", "fold_from_spec": "base", "register_fold": "base",
}

__all__ = [
    "Bundle",
    "Fold",
    "FoldError",
    "MeanFold",
    "ModularFold",
    "RoundBarrier",
    "RoundError",
    "RoundResult",
    "SumFold",
    "fold_from_spec",
    "register_fold",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flodld.fold' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flodld.fold.{home}"), name)
