"""When a round stops waiting for its stragglers: the `straggler_timeout` rule, sans-io (time is an argument).

Under `cpu_cadence` and `cpu_async` a round opens when its first deposit arrives (at a relay: a rank's
first chunk; at the controller: a host's first chunk); a member that has not deposited all of the round
`timeout` seconds later is skipped for that round only (`RoundBarrier.skip`): the round closes over those
who deposited, the skipped member stays a member, and its deposit of that round, when it comes, is late
and dropped. The shells (the relay, the controller's data plane) call `opened` when a round takes its
first chunk and `wake_at` to know when to look again (or `arm`, both at once), and `late` (or `due`) to
know whom to skip now.
`cpu_sync` has no straggler timeout: every round waits for every live member.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from flodld.fold.barrier import RoundBarrier

Member = TypeVar("Member", int, str)  # a relay's ranks, the controller's hosts


class StragglerClock:
    """The open round's deadline: `timeout` seconds after its first deposit (None: never)."""

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"straggler_timeout must be a positive number of seconds, got {timeout}")
        self.timeout = timeout
        self._round: int | None = None
        self._opened = 0.0

    def opened(self, round_number: int, now: float) -> None:
        """A chunk of `round_number` was taken at `now`; the first one opens the round's clock."""
        if self._round != round_number:
            self._round, self._opened = round_number, now

    def arm(self, round_number: int, now: float) -> float | None:
        """A chunk of `round_number` was taken at `now`: when its stragglers are due, if this chunk opened
        the round's clock (the shell sets its timer then); None if it was open already, or no timeout.
        """
        if self.timeout is None or self.wake_at(round_number) is not None:
            return None
        self.opened(round_number, now)
        return self.wake_at(round_number)

    def wake_at(self, round_number: int) -> float | None:
        """When `round_number`'s stragglers are due to be skipped; None if it is not open or no timeout."""
        if self.timeout is None or self._round != round_number:
            return None
        return self._opened + self.timeout

    def due(self, round_number: int, now: float) -> bool:
        """Whether `round_number`'s members that still owe their deposit are to be skipped now."""
        deadline = self.wake_at(round_number)
        return deadline is not None and now >= deadline

    def late(
        self, barrier: RoundBarrier[Member] | None, round_number: int, now: float
    ) -> list[Member] | None:
        """The members to skip now (sorted): those that still owe `round_number`, if it is still the
        barrier's round and due; None if there is nothing to skip.
        """
        if barrier is None or barrier.round != round_number or not self.due(round_number, now):
            return None
        return sorted(barrier.waiting_for)
