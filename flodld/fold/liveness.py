"""Who is silent too long: the coordinator's heartbeat bookkeeping, sans-io (time is an argument).

Every tracked rank starts its clock when tracking starts, so a rank that never speaks at all is
declared dead too — after `startup` seconds (default: the timeout), since a rank's first heartbeat waits
for its process to start and import torch; once heard, `timeout` applies. A rank that left (EOF,
reported exit) stops being tracked.
"""

from __future__ import annotations

from collections.abc import Iterable


class Liveness:
    def __init__(
        self, ranks: Iterable[int], *, timeout: float, now: float, startup: float | None = None
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"liveness timeout must be positive seconds, got {timeout}")
        if startup is not None and not startup >= timeout:
            raise ValueError(f"liveness startup grace must be >= the timeout ({timeout}s), got {startup}")
        self.timeout = timeout
        self.startup = timeout if startup is None else startup
        self._last_heard = {rank: now for rank in ranks}
        self._silent_since_start = set(self._last_heard)  # never heard: the startup grace applies

    @property
    def tracked(self) -> frozenset[int]:
        return frozenset(self._last_heard)

    def heard(self, rank: int, now: float) -> float | None:
        """Record a sign of life; ignored for ranks no longer tracked. The silence it ends (seconds since the
        rank's last sign of life; None for its first, or an untracked rank): how close a healthy rank came
        to the timeout.
        """
        last = self._last_heard.get(rank)
        if last is None:
            return None
        gap = None if rank in self._silent_since_start else max(0.0, now - last)
        self._last_heard[rank] = max(last, now)
        self._silent_since_start.discard(rank)
        return gap

    def track(self, ranks: Iterable[int], now: float) -> None:
        """Start tracking `ranks` (walk-ins during training): their clock starts now, startup grace first."""
        for rank in ranks:
            if rank not in self._last_heard:
                self._last_heard[rank] = now
                self._silent_since_start.add(rank)

    def forget(self, rank: int) -> None:
        self._last_heard.pop(rank, None)
        self._silent_since_start.discard(rank)

    def expire(self, now: float) -> list[int]:
        """Ranks silent for longer than allowed, in rank order; they stop being tracked."""
        return [rank for rank, _ in self.expire_with_limits(now)]

    def expire_with_limits(self, now: float) -> list[tuple[int, float]]:
        """Like `expire`, with the silence each rank was allowed (the startup grace or the timeout)."""
        dead = sorted(
            (rank, self._limit(rank))
            for rank, last in self._last_heard.items()
            if now - last > self._limit(rank)
        )
        for rank, _ in dead:
            self.forget(rank)
        return dead

    def next_expiry(self) -> float | None:
        """When the first tracked rank still silent by then is declared dead (None: none is tracked)."""
        return min((last + self._limit(rank) for rank, last in self._last_heard.items()), default=None)

    def _limit(self, rank: int) -> float:
        return self.startup if rank in self._silent_since_start else self.timeout
