"""Who is silent too long: the coordinator's heartbeat bookkeeping, sans-io (time is an argument).

Every tracked rank starts its clock when tracking starts, so a rank that never speaks at all is
declared dead too; a rank that left (EOF, reported exit) stops being tracked.
"""

from __future__ import annotations

from collections.abc import Iterable


class Liveness:
    def __init__(self, ranks: Iterable[int], *, timeout: float, now: float) -> None:
        if not timeout > 0:
            raise ValueError(f"liveness timeout must be positive seconds, got {timeout}")
        self.timeout = timeout
        self._last_heard = {rank: now for rank in ranks}

    @property
    def tracked(self) -> frozenset[int]:
        return frozenset(self._last_heard)

    def heard(self, rank: int, now: float) -> None:
        """Record a sign of life; ignored for ranks no longer tracked."""
        if rank in self._last_heard:
            self._last_heard[rank] = max(self._last_heard[rank], now)

    def forget(self, rank: int) -> None:
        self._last_heard.pop(rank, None)

    def expire(self, now: float) -> list[int]:
        """Ranks silent for longer than the timeout, in rank order; they stop being tracked."""
        dead = sorted(rank for rank, last in self._last_heard.items() if now - last > self.timeout)
        for rank in dead:
            del self._last_heard[rank]
        return dead
