"""Rank liveness on the data plane's CONTROL channel: heartbeats in, a coordinator heartbeat out.

Each relay forwards its ranks' heartbeats (`heard`); every `heartbeat_interval` a CoordinatorHeartbeat goes
down every CONTROL relay (`tick`), and a rank silent past its timeout (a rank never heard from gets the
startup grace) is declared dead: DeclareDead to its relay, which folds it out, then `rank_left` (the
plane's: the rank leaves the round) and `on_rank_dead` (the controller's: a loss against the tolerance),
the reason naming rank, host, silence and the round in progress.

`RankWatch` is the data plane's (controller/dataplane.py) watch over its ranks; the plane owns the relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from flodld.fold.liveness import Liveness
from flodld.net.stream import FramedStream
from flodld.wire.control import CoordinatorHeartbeat, DeclareDead, Shutdown
from flodld.wire.messages import Message

# The data plane's log: a rank declared dead reads among the plane's other events.
log = logging.getLogger("flodld.controller.dataplane")

DEFAULT_LIVENESS_TIMEOUT_SECS = 30.0
# A run that survives a rank's loss (a tolerance, CPU averaging) declares a silent rank dead sooner: the
# survivors' round waits for it until then, and a false declaration costs one rank, not the run.
DEFAULT_ELASTIC_LIVENESS_TIMEOUT_SECS = 5.0
DEFAULT_HEARTBEAT_INTERVAL_SECS = 1.0
# A rank's first heartbeat waits for its process to start, import the program and torch, and reach its
# relay: on a loaded box that can take far longer than the steady-state timeout, so it gets its own bound.
DEFAULT_LIVENESS_STARTUP_SECS = 120.0

# A live rank's heartbeat gap past this share of the liveness timeout is logged (a false alarm is near).
GAP_WARNING_SHARE = 0.5
# Past a deadline by this much before looking (expiry is "silent longer than", and timers fire a hair early).
EXPIRY_SLACK_SECS = 0.002

Send = Callable[[FramedStream, Message], Awaitable[None]]  # a send that shrugs off a closed relay
RankLeft = Callable[[str, int, str], Awaitable[None]]  # (host, rank, reason): a rank declared dead leaves


class RankWatch:
    """The liveness table of the world's ranks and the ticker that beats and expires them."""

    def __init__(
        self,
        host_of: Mapping[int, str],
        control_relays: Mapping[str, FramedStream],
        *,
        timeout: float,
        startup: float | None,
        interval: float,
        clock: Callable[[], float],
        send: Send,
        rank_left: RankLeft,
        round_in_progress: Callable[[int], int | None],
        on_rank_dead: Callable[[int, str], None] | None = None,
    ) -> None:
        self.host_of = host_of  # the plane's: a walk-in's ranks are added there when it is expected
        self.control_relays = control_relays  # the plane's relays on CONTROL, by host
        self.clock = clock
        self.liveness = Liveness(host_of, timeout=timeout, now=clock(), startup=startup)
        self.interval = interval
        self.on_rank_dead = on_rank_dead
        self._send = send
        self._rank_left = rank_left
        self._round_in_progress = round_in_progress
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the liveness clock and the coordinator heartbeat (call inside the event loop)."""
        if self._ticker is None:
            self.liveness = Liveness(
                self.liveness.tracked,
                timeout=self.liveness.timeout,
                now=self.clock(),
                startup=self.liveness.startup,
            )
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def shutdown(self, reason: str) -> None:
        """Tell every rank the run is over (they exit), then stop the ticker."""
        for stream in list(self.control_relays.values()):
            await self._send(stream, Shutdown(reason=reason[:1024]))
        await self.close()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    def heard(self, rank: int) -> float | None:
        """A heartbeat of `rank`: the silence it ends (None: its first, or a rank not watched)."""
        return self.liveness.heard(rank, self.clock())

    def longest_gap(self, host: str, rank: int, gap: float) -> None:
        """The run's longest heartbeat gap yet (RunMetrics keeps it): logged when a live rank came within
        GAP_WARNING_SHARE of the timeout, before a slower one turns into a false alarm.
        """
        timeout = self.liveness.timeout
        if gap > timeout * GAP_WARNING_SHARE:
            log.warning(
                "event=heartbeat_gap_near_timeout host=%s rank=%d gap_secs=%.3f timeout_secs=%g "
                "hint='a longer FLODL_LIVENESS_TIMEOUT_SECS avoids declaring a slow rank dead'",
                host,
                rank,
                gap,
                timeout,
            )

    def track(self, ranks: Iterable[int]) -> None:
        """Watch a walk-in's ranks, with the startup grace."""
        self.liveness.track(ranks, self.clock())

    async def _tick_forever(self) -> None:
        """Beat every `interval`, and wake at the first silent rank's deadline too: a rank is declared dead
        when its silence passes the timeout, not up to a beat later (every such wait holds a `cpu_sync`
        round of the survivors).
        """
        next_beat = self.clock() + self.interval
        while True:
            due = self.liveness.next_expiry()
            wake = next_beat if due is None else min(next_beat, due + EXPIRY_SLACK_SECS)
            await asyncio.sleep(max(0.001, wake - self.clock()))
            if self.clock() >= next_beat:
                next_beat = max(next_beat + self.interval, self.clock())
                await self.beat()
            await self.expire()

    async def tick(self) -> None:
        """One coordinator beat: heartbeat every relay, declare silent ranks dead."""
        await self.beat()
        await self.expire()

    async def beat(self) -> None:
        """The coordinator heartbeat down every CONTROL relay (a rank that hears none gives up)."""
        for stream in list(self.control_relays.values()):
            await self._send(stream, CoordinatorHeartbeat())

    async def expire(self) -> None:
        """Declare every rank silent past its limit dead."""
        for rank, silence in self.liveness.expire_with_limits(self.clock()):
            host = self.host_of[rank]
            in_round = self._round_in_progress(rank)
            during = f" (round {in_round} in progress)" if in_round is not None else ""
            reason = f"rank {rank} on {host!r} sent no heartbeat for {silence:g}s{during}"
            log.warning("event=rank_declared_dead host=%s rank=%d", host, rank)
            control = self.control_relays.get(host)
            if control is not None:
                await self._send(control, DeclareDead(rank=rank, reason=reason))
            await self._rank_left(host, rank, reason)
            if self.on_rank_dead is not None:
                try:
                    self.on_rank_dead(rank, reason)
                except Exception:  # a failing listener must not stop the heartbeat ticker
                    log.exception("event=rank_dead_listener_failed rank=%d", rank)
