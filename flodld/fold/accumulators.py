"""The round barrier's accumulators (`flodld.fold.barrier`): allocated once per schema and fold and reused
round after round (by round parity when two are kept: the top-level hop may fold round r + 1 while a send
of round r still reads its accumulator), with memory faulted in ahead for the next new one (`prepare`).
"""

from __future__ import annotations

from flodld.fold.base import Bundle, Fold, FoldError
from flodld.fold.chunks import Layout, Prefaulted
from flodld.wire.data import TensorSpec


class Accumulators:
    """`count` (1 or 2) accumulators, by round parity; `spare`: memory faulted in for the next new one."""

    def __init__(self, count: int) -> None:
        if count not in (1, 2):
            raise ValueError(f"a round barrier keeps 1 or 2 accumulators, not {count}")
        # By round parity: (fold spec, schema, tensors) or None.
        self._kept: list[tuple[str, tuple[TensorSpec, ...], Bundle] | None] = [None] * count
        self.spare = Prefaulted()

    def prepare(self, nbytes: int) -> None:
        """Fault in `nbytes` of memory now for the next accumulator to make (the first round of a new
        schema whose bundle is at least half of it).
        """
        if not self.spare.holds(nbytes):
            self.spare.fault_in(nbytes)

    def for_round(self, round_number: int, fold: Fold, layout: Layout) -> Bundle:
        """The kept accumulator when schema and fold are the round before's, else a new one, uninitialised:
        the barrier starts each chunk of it from its first member (`start_slice`, or zeroed and added to),
        and a chunk nobody folded is never handed on. `identity` still judges the schema first (FoldError,
        before anything is kept), on meta tensors (shapes and dtypes, no memory): a round whose schema
        changed no longer allocates and zero-fills a whole accumulator only to start it again chunk by
        chunk. A plugin fold whose `identity` cannot take meta tensors gets real ones.
        """
        slot = round_number % len(self._kept)
        kept = self._kept[slot]
        if kept is not None and kept[0] == fold.spec and kept[1] == layout.specs:
            return kept[2]
        self._kept[slot] = None  # drop the old accumulator before allocating the new one
        try:
            fold.identity(layout.empty(device="meta"))
        except FoldError:
            raise
        except Exception:  # a fold that needs real memory to judge: its own identity
            return fold.identity(layout.empty())
        tensors = self.spare.take(layout)
        return tensors if tensors is not None else layout.empty_flat()

    def keep(self, round_number: int, fold: Fold, layout: Layout, tensors: Bundle) -> None:
        """`tensors` is the accumulator of `round_number` (its first chunk was accepted)."""
        self._kept[round_number % len(self._kept)] = (fold.spec, layout.specs, tensors)
