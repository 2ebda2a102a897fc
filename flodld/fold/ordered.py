"""One chunk of a round barrier's round (`flodld.fold.barrier`), folded in the fixed member order.

A member's chunk that arrives before those of the members ahead of it in that order is parked (its
buffer held) until they are in, so the float sums are the same bit for bit at every chunk size and every
arrival order; a member that left or was skipped is passed over. The accumulator is reused (and a new
one uninitialised): the chunk's first member starts it, in one pass where the fold can (`start_slice`),
else zeroed and added to.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from flodld.fold.base import Bundle, Fold
from flodld.fold.chunks import Piece, Run, held, run_view

Member = TypeVar("Member", bound=Hashable)
Release = Callable[[], None]


@dataclass
class OrderedChunk(Generic[Member]):
    """The chunk at one offset: its contributions parked, how far the fold order has folded it, and the
    summed weight and members of what it folded. `complete` once no member ahead is still to come.
    """

    length: int
    pieces: tuple[Piece, ...]
    parked: dict[Member, tuple[list[torch.Tensor], float, Release | None]] = field(default_factory=dict)
    position: int = 0  # index into the round's fold order
    weight: float = 0.0
    folded: set[Member] = field(default_factory=set)
    complete: bool = False
    # Runs of `flat` (a FlatBundle's bytes) instead of pieces, for an elementwise fold (set by the barrier).
    runs: tuple[Run, ...] | None = None
    flat: torch.Tensor | None = None
    targets: list[torch.Tensor] | None = None  # the accumulator's slices of each piece or run, once looked up

    def drain(
        self, fold: Fold, accumulator: Bundle, order: Sequence[Member], coming: Callable[[Member], bool]
    ) -> None:
        """Fold the parked contributions in `order`, as far as they have arrived (`coming`: whether a
        member's chunk is still to come, i.e. it is live and not skipped).
        """
        while self.position < len(order):
            member = order[self.position]
            parked = self.parked.pop(member, None)
            if parked is None:
                if coming(member):
                    return  # its chunk is still to come
                self.position += 1  # left (or was skipped) before sending this chunk
                continue
            incoming, weight, release = parked
            start = getattr(fold, "start_slice", None) if not self.folded else None
            slices: Sequence[Piece | Run] = self.pieces
            if self.runs is not None and self.flat is not None:
                slices = self.runs
                if self.targets is None:
                    self.targets = [run_view(self.flat, run) for run in self.runs]
            elif self.targets is None:
                self.targets = [held(accumulator, piece) for piece in self.pieces]
            for piece, tensor, target in zip(slices, incoming, self.targets, strict=True):
                if start is not None:
                    start(target, tensor, piece.span)
                    continue
                if not self.folded:
                    target.zero_()
                fold.add_slice(target, tensor, piece.span)
            del incoming
            self.weight += weight
            self.folded.add(member)
            self.position += 1
            if release is not None:
                release()
        self.complete = True
