"""Which ranks each averaging round counted, and where each rank was last seen (pure bookkeeping).

The data plane (controller/dataplane.py) notes every host chunk it folds, every chunk it broadcasts,
every rank's heartbeat step and the round a rank's relay reported it gone in. From these the ledger
answers two questions: which round a lost rank was lost in (`round_in_progress`, named with each loss),
and whose deposit a round went without (`round_done`, counted as skipped under a straggler timeout).
"""

from __future__ import annotations

from collections.abc import Iterable


class RoundLedger:
    """The ranks in the rounds folded here, and each rank's last round, step and leaving round."""

    def __init__(self) -> None:
        self._chunk_ranks: dict[int, set[int]] = {}  # ranks in the open chunks of this round, by offset
        self._round_ranks: set[int] = set()  # ranks in the chunks of this round broadcast so far
        self._last_step: dict[int, int] = {}  # each rank's step (rounds it has taken) at its last heartbeat
        self._last_round: dict[int, int] = {}  # the last round a host frame counted each rank in
        self._left_round: dict[int, int] = {}  # the round its relay was in when each rank left (RankGone)

    def host_chunk(self, round_number: int, offset: int, contributors: Iterable[int]) -> None:
        """A host's chunk at `offset` of `round_number` was taken, counting `contributors`."""
        ranks = self._chunk_ranks.setdefault(offset, set())
        for rank in contributors:
            ranks.add(rank)
            self._last_round[rank] = round_number

    def chunk_done(self, offset: int) -> set[int]:
        """The chunk at `offset` is broadcast: the ranks it counted."""
        contributors = self._chunk_ranks.pop(offset, set())
        self._round_ranks |= contributors
        return contributors

    def round_done(self, live: set[int]) -> list[int]:
        """The round's last chunk is broadcast: the `live` ranks whose deposit it went without."""
        self._chunk_ranks.clear()
        missing = sorted(live - self._round_ranks)
        self._round_ranks = set()
        return missing

    def heard(self, rank: int, step: int) -> None:
        self._last_step[rank] = step

    def left(self, rank: int, round_number: int | None) -> int | None:
        """`rank`'s relay says it left in `round_number` (None: it did not say): that round, the first time
        it is said (later words are ignored, None).
        """
        if round_number is None or rank in self._left_round:
            return None
        self._left_round[rank] = round_number
        return round_number

    def round_in_progress(self, rank: int, folding: int | None) -> int | None:
        """The averaging round `rank` was lost in: the round its relay was in when it left (RankGone); else
        the one after the last round its host's frames counted it in (a silent rank's survivors may have
        finished that round without it by now); a rank never counted, the world's round being folded here
        (`folding`); a sole host's silent rank (its relay folds), its own count of rounds taken at its last
        heartbeat. None before any of these.
        """
        left = self._left_round.get(rank)
        if left is not None:
            return left
        last = self._last_round.get(rank)
        if last is not None:
            return last + 1
        if folding is not None:
            return folding
        return self._last_step.get(rank)
