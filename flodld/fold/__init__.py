"""Sans-io folding of deposits: pluggable reductions and the round barrier that drives them.

The reductions need torch, the liveness table does not: nothing here imports torch. Import the
torch-backed names from their modules (`flodld.fold.base`, `.barrier`, `.chunks`, `.codec`); a process
that folds only when a deposit arrives (the relay, the controller) builds its barrier through
`round_barrier`, the one lazy, typed way in, which loads torch and sets the fold threads on first use;
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
    global _threads_set
    from flodld.fold.barrier import RoundBarrier
    from flodld.fold.base import use_fold_threads

    if not _threads_set:
        use_fold_threads()
        _threads_set = True
    return RoundBarrier(members, accumulators=accumulators, weights_may_drop=weights_may_drop)


def register_fold(name: str, factory: Callable[[str], Fold]) -> None:
    """`flodld.fold.base.register_fold`, reachable from the package (importing it loads torch)."""
    from flodld.fold.base import register_fold as register

    register(name, factory)
