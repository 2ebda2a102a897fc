"""Which rounds each member of a round barrier was skipped in (`RoundBarrier.skip`: a straggler past the
run's `straggler_timeout`) and has not deposited past yet: its chunks of those rounds, arriving after,
are late (dropped, never folded into another round). At most `MAX_LATE_ROUNDS` are remembered per member;
a chunk of an older one is refused as out of turn.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

Member = TypeVar("Member", bound=Hashable)
MAX_LATE_ROUNDS = 4096
"""Rounds remembered per member as skipped (its late chunks of older ones are refused as out of turn)."""


class SkippedRounds(Generic[Member]):
    def __init__(self) -> None:
        self._rounds: dict[Member, set[int]] = {}

    def skipped(self, member: Member, round_number: int) -> None:
        rounds = self._rounds.setdefault(member, set())
        rounds.add(round_number)
        if len(rounds) > MAX_LATE_ROUNDS:
            rounds.discard(min(rounds))

    def was_skipped(self, member: Member, round_number: int) -> bool:
        return round_number in self._rounds.get(member, ())

    def deposits(self, member: Member, round_number: int) -> None:
        """`member` deposits in `round_number`: the rounds it missed before this one can no longer come."""
        rounds = self._rounds.get(member)
        if rounds:
            rounds.difference_update([number for number in rounds if number < round_number])

    def forget(self, member: Member) -> None:
        """`member` left: none of its chunks is late any more (they are refused: it left)."""
        self._rounds.pop(member, None)
