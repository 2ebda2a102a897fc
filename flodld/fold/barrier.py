"""The round barrier: who still owes a deposit this round, and the running fold of those who paid.

Used twice with the same rules: by a relay over its local ranks, and by the controller over
hosts (a host frame is a partial fold). Rules:

- a round completes when every live member has contributed; the result is the partial sum and
  summed weight (`finish` is the top-level caller's job);
- a member that leaves is folded out: if it had not contributed, the round stops waiting for it;
  if it had, its contribution stays in the round;
- contributing twice to one round, contributing after leaving, or contributing to another round
  number is an error (the caller's peer is broken, and the message says so);
- all contributions of a round must name the same fold spec.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from flodld.fold.base import Bundle, Fold, FoldError, fold_from_spec

Member = TypeVar("Member", bound=Hashable)


class RoundError(ValueError):
    """A contribution breaks the barrier's rules; the message names the member and the rule."""


@dataclass(frozen=True)
class RoundResult(Generic[Member]):
    """A completed round: partial sum, total weight, and who is in it."""

    round: int
    fold_spec: str
    tensors: Bundle
    weight: float
    contributors: frozenset[Member]


class RoundBarrier(Generic[Member]):
    """Sans-io barrier that folds contributions incrementally, so memory stays at one accumulator."""

    def __init__(self, members: Iterable[Member], *, first_round: int = 0) -> None:
        self._live: set[Member] = set(members)
        if not self._live:
            raise RoundError("a round barrier needs at least one member")
        self._gone: set[Member] = set()
        self.round = first_round
        self._reset()

    def _reset(self) -> None:
        self._paid: set[Member] = set()
        self._fold: Fold | None = None
        self._accumulator: Bundle | None = None
        self._weight = 0.0

    @property
    def live(self) -> frozenset[Member]:
        return frozenset(self._live)

    @property
    def waiting_for(self) -> frozenset[Member]:
        """Live members that still owe this round."""
        return frozenset(self._live - self._paid)

    def contribute(
        self, member: Member, round_number: int, fold_spec: str, tensors: Bundle, weight: float
    ) -> RoundResult[Member] | None:
        """Fold one contribution; returns the result when it completes the round."""
        if member in self._gone:
            raise RoundError(f"{member!r} contributed after it left the round")
        if member not in self._live:
            raise RoundError(
                f"{member!r} is not a member of this round (members: {sorted(map(repr, self._live))})"
            )
        if member in self._paid:
            raise RoundError(
                f"{member!r} deposited twice in round {self.round} (a double deposit is an error)"
            )
        if round_number != self.round:
            raise RoundError(
                f"{member!r} deposited for round {round_number} but the barrier is at round {self.round}"
            )
        if not weight >= 0 or weight == float("inf"):
            raise RoundError(f"{member!r} deposited weight {weight}; weights must be finite and >= 0")
        if self._fold is None:
            self._fold = fold_from_spec(fold_spec)
            self._accumulator = self._fold.identity(tensors)
        elif fold_spec != self._fold.spec:
            raise FoldError(
                f"{member!r} folds with {fold_spec!r} but round {self.round} folds with {self._fold.spec!r}"
            )
        assert self._accumulator is not None
        self._accumulator = self._fold.add(self._accumulator, tensors)
        self._weight += weight
        self._paid.add(member)
        return self._complete_if_done()

    def remove(self, member: Member) -> RoundResult[Member] | None:
        """Fold a member out (EOF, declared dead); returns a result if that was all the round awaited."""
        if member not in self._live:
            return None
        self._live.discard(member)
        self._gone.add(member)
        return self._complete_if_done()

    def _complete_if_done(self) -> RoundResult[Member] | None:
        if self._live - self._paid or self._fold is None:
            return None
        assert self._accumulator is not None
        result = RoundResult(
            round=self.round,
            fold_spec=self._fold.spec,
            tensors=self._accumulator,
            weight=self._weight,
            contributors=frozenset(self._paid),
        )
        self.round += 1
        self._reset()
        return result
