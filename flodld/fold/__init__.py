"""Sans-io folding of deposits: pluggable reductions and the round barrier that drives them.

The reductions need torch, the liveness table does not: nothing here imports torch. Import the
torch-backed names from their modules (`flodld.fold.base`, `.barrier`, `.chunks`, `.codec`); a process
that folds only when a deposit arrives (the relay, the controller) builds its barrier through
`round_barrier`, the one lazy, typed way in, which loads torch and sets the fold threads on first use
(`load_fold` does that part ahead of time, in a worker thread of a shell whose loop must not stall);
`register_fold` plugs a fold in (it loads torch too).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from flodld.fold.barrier import RoundBarrier
    from flodld.fold.base import Fold

Member = TypeVar("Member", bound=Hashable)

_threads_set = False


def round_barrier(
    members: Iterable[Member], *, accumulators: int = 1, weights_may_drop: bool = False
) -> RoundBarrier[Member]:
    """A new `RoundBarrier` over `members`; the first call imports torch and applies `use_fold_threads`."""
    load_fold()
    from flodld.fold.barrier import RoundBarrier

    return RoundBarrier(members, accumulators=accumulators, weights_may_drop=weights_may_drop)


def fold_loaded() -> bool:
    """Whether `load_fold` ran (torch and the barrier are imported, the fold threads set)."""
    return _threads_set


def load_fold() -> None:
    """Import torch and the barrier, and apply `use_fold_threads`, once (a second caller racing the first
    does it again, harmlessly). An event loop calls it in a worker thread before its first fold (the relay,
    the controller's data plane): the import takes seconds on a loaded machine, and made on the loop it
    would stall the ranks' heartbeats that loop forwards, past a short liveness timeout.
    """
    global _threads_set
    if not _threads_set:
        from flodld.fold.barrier import RoundBarrier  # noqa: F401  the import is the point
        from flodld.fold.base import use_fold_threads

        use_fold_threads()
        # Each new schema is judged on meta tensors first (flodld/fold/accumulators.py), and torch's first
        # meta op imports its symbolic-shape machinery, sympy included: ~0.22 s under the interpreter lock
        # on a loaded machine, which fell on the loop at the first round (the longest heartbeat gap of a
        # chaos run). Done here, it falls in this worker thread.
        import torch

        torch.zeros_like(torch.empty(1, device="meta"))
        _threads_set = True


def register_fold(name: str, factory: Callable[[str], Fold]) -> None:
    """`flodld.fold.base.register_fold`, reachable from the package (importing it loads torch)."""
    from flodld.fold.base import register_fold as register

    register(name, factory)
