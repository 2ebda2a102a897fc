"""The controller's end of the CPU-reduce data plane and of rank liveness (DATA and CONTROL channels).

One relay per host dials each channel and is seated by `RelayAdmission` (relayadmission.py: its hello
proves its host's admission key; the connection is then rekeyed to that key). On DATA, host frames
are folded across hosts chunk by chunk (a RoundBarrier over hosts with live ranks); each chunk, finished
as soon as every live host's chunk at that offset is in, goes down as a Broadcast chunk to every relay,
so a large round is pipelined rather than stored and forwarded whole; a `RoundLedger` (roundledger.py)
notes which ranks each round counted. A world of one host skips these two hops: the HelloAck on its
DATA channel says `sole_host`, its relay broadcasts its own fold to its ranks, and a host frame arriving
here anyway is refused (`rounds` counts only rounds folded here). A host admitted during training enters
at a round boundary through `WalkIns` (walkins.py). On CONTROL, rank heartbeats feed the Liveness table
of a `RankWatch` (rankwatch.py): a coordinator heartbeat goes down every interval, and a rank silent
past the timeout is declared dead: its relay folds it out, and `on_rank_dead` tells the rest of the
controller.

A rank that leaves (RankGone, its relay's DATA channel closed, declared dead) leaves the barrier, the
liveness table and the walk-ins' waiting list in one place: `_rank_left`.

Register with the mux: `mux.register(Channel.DATA, plane.handle_data)` and
`mux.register(Channel.CONTROL, plane.handle_control)`, then `plane.start()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flodld.controller.rankwatch import (
    DEFAULT_HEARTBEAT_INTERVAL_SECS,
    DEFAULT_LIVENESS_TIMEOUT_SECS,
    RankWatch,
)
from flodld.controller.relayadmission import RelayAdmission
from flodld.controller.roundledger import RoundLedger
from flodld.controller.status.metrics import RunMetrics
from flodld.controller.walkins import WalkIns
from flodld.fold import round_barrier
from flodld.net.dispatch import serve_frames
from flodld.net.inorder import InOrder
from flodld.net.stream import FramedStream
from flodld.relay.foldload import FoldLoad
from flodld.relay.stragglers import RoundStragglers
from flodld.wire.control import DeclareDead, Heartbeat
from flodld.wire.data import Broadcast, DataPlaneError, HostFrame, RankConnected, RankExpected, RankGone
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame, Tail
from flodld.wire.handlers import HandlerTable
from flodld.wire.magic import Channel
from flodld.wire.messages import Message, encode_message

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.controller.dataplane")

RankDeadCallback = Callable[[int, str], None]
HostKeyLookup = Callable[[str], bytes | None]
"""The key derived at `host`'s admission, or None when that host has no live admission."""


@dataclass(frozen=True)
class _Relay:
    """Whose frames a relay connection carries (the context of its dispatch table)."""

    host: str
    stream: FramedStream


@dataclass(frozen=True)
class DataPlaneStats:
    rounds: int  # rounds folded here (a sole host's relay folds its rounds itself: 0)
    live_hosts: list[str]
    dead_ranks: list[int]
    gone_ranks: list[int]
    refusals: dict[str, int]


class DataPlane:
    """Serves relays of one formed world; built by the controller after formation."""

    def __init__(
        self,
        salt: bytes,
        host_ranks: Mapping[str, Sequence[int]],
        *,
        host_key: HostKeyLookup,
        refusals: Counter[str] | None = None,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT_SECS,
        startup_timeout: float | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_SECS,
        on_rank_dead: RankDeadCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: RunMetrics | None = None,
        straggler_timeout: float | None = None,
        growable: bool = False,
        chunk_env: Mapping[str, str] | None = None,
    ) -> None:
        if not host_ranks:
            raise ValueError("a data plane needs at least one host")
        # Refused relays and frames by reason; the controller passes its `dropped` counter (state.json,
        # /metrics).
        self.refusals: Counter[str] = refusals if refusals is not None else Counter()
        # Rounds, round times, per-rank delays and reported rounds, tensor bytes (/metrics); the controller
        # passes its run's tally.
        self.metrics = metrics if metrics is not None else RunMetrics()
        self.metrics.liveness_timeout, self.metrics.heartbeat_interval = liveness_timeout, heartbeat_interval
        self.host_ranks = {host: sorted(ranks) for host, ranks in host_ranks.items()}
        self.host_of = {rank: host for host, ranks in self.host_ranks.items() for rank in ranks}
        self.live_ranks = {host: set(ranks) for host, ranks in self.host_ranks.items()}
        # A world of one host: its relay's fold is the world's, so it broadcasts rounds itself (told so in
        # its DATA HelloAck) and no data frame comes here; liveness and RankGone work as for any world.
        # A run that grows (walk-ins during training) folds here even with one host: a walk-in may join it.
        self.sole_host = len(self.host_ranks) == 1 and not growable
        self.admission = RelayAdmission(
            salt, self.host_ranks, host_key=host_key, refusals=self.refusals, sole_host=self.sole_host
        )
        self.relays = self.admission.relays
        self.walk_ins = WalkIns(
            self.relays[Channel.DATA], self.live_ranks, metrics=self.metrics, chunk_env=chunk_env
        )
        # The fold machinery (torch) loads in a worker thread from `start` (the world formed) unless the
        # relays fold (a sole host): a run that never averages through the relays never pays for it, and
        # the import is over before the first host frame, not in round 0 with every liveness clock running.
        self._barrier: RoundBarrier[str] | None = None
        self._fold = FoldLoad(loaded_level=logging.INFO)  # event=fold_loaded in the controller's log
        self.clock = clock
        self.watch = RankWatch(
            self.host_of,
            self.relays[Channel.CONTROL],
            timeout=liveness_timeout,
            startup=startup_timeout,
            interval=heartbeat_interval,
            clock=clock,
            send=self._send_quietly,
            rank_left=lambda host, rank, reason: self._rank_left(host, rank, reason, dead=True),
            round_in_progress=self.round_in_progress,
            on_rank_dead=on_rank_dead,
        )
        self.rounds = 0
        self.ledger = RoundLedger()
        self._outbox = InOrder()  # broadcast chunks leave in the order the fold made them
        # cpu_cadence/cpu_async with a straggler_timeout: a round stops waiting for late hosts after twice
        # the timeout, so that a host whose relay is waiting out its own late rank (the timeout, from its
        # own first deposit) is not skipped with it: the relays skip late ranks, the controller late hosts.
        late_after = 2 * straggler_timeout if straggler_timeout is not None else None
        self.stragglers: RoundStragglers[str] = RoundStragglers(
            late_after, lambda results: self._outbox.send(results, self._broadcast),
            skipped=lambda round_number, hosts: log.warning(
                "event=round_skipped_hosts round=%d hosts=%s timeout=%g", round_number, hosts, late_after
            ),
            clock=clock,
        )
        self.dead_ranks: list[int] = []
        self.gone_ranks: list[int] = []
        # Told the round a rank left in, once its relay says (a loss recorded earlier is corrected with it).
        self.on_rank_round: Callable[[int, int], None] | None = None
        self._data: HandlerTable[[_Relay, Frame], Awaitable[bool | None]] = HandlerTable("host data frame")
        self._data.register(HostFrame, self._on_host_frame)
        self._data.register(RankGone, self._on_rank_gone)
        self._data.register(RankConnected, self._on_rank_connected)
        self._control: HandlerTable[[_Relay, Frame], Awaitable[bool | None]] = HandlerTable(
            "host control frame"
        )
        self._control.register(Heartbeat, self._on_heartbeat)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the liveness clock, the coordinator heartbeat and, where this plane folds, the fold's load
        (inside the event loop, as the world forms: not at the window's opening, since a daemon stopped while
        torch loads waits for the import, and a window that never forms should load no torch).
        """
        self.watch.start()
        if not self.sole_host:
            self._fold.start()

    async def shutdown(self, reason: str) -> None:
        """Tell every rank the run is over (they exit), then stop the ticker."""
        await self.watch.shutdown(reason)

    async def close(self) -> None:
        await self.watch.close()

    def expect(self, host: str, ranks: Sequence[int], rides: str | None = None) -> str | None:
        """A host walked into the training run: its relay may connect, its ranks are watched (with the
        startup grace), and they enter the averaging at a round boundary once its DATA channel is up.

        A healed slot that asks to ride `rides`'s relay (Hello.rides) does, when that relay is in the
        averaging (`can_ride`): its ranks are that host's from here on (its relay is told, RankExpected),
        and no relay of `host` is seated. Returns the host whose relay the ranks ride, or None.
        """
        ranks = sorted(ranks)
        ride = rides if rides is not None and self.can_ride(rides) else None
        seat = host if ride is None else ride
        self.host_ranks[seat] = sorted({*self.host_ranks.get(seat, ()), *ranks}) if ride else ranks
        for rank in ranks:
            self.host_of[rank] = seat
        self.live_ranks.setdefault(seat, set())
        self.watch.track(ranks)
        self.walk_ins.expect(seat, ranks, riders=ride is not None)
        if ride is not None:
            relay = self.relays[Channel.DATA][ride]
            for rank in ranks:
                relay.send_nowait(RankExpected(rank=rank))  # before its WorldFormed is even shipped
        log.info("event=walk_in_expected host=%s ranks=%s rides=%s", host, ranks, ride)
        return ride

    def can_ride(self, host: str) -> bool:
        """Whether `host`'s relay can take riders: in the averaging (its ranks entered, some live) with both
        channels seated.
        """
        return (
            bool(self.live_ranks.get(host))
            and host not in self.walk_ins.entering
            and all(host in self.relays[channel] for channel in (Channel.DATA, Channel.CONTROL))
        )

    def live_hosts(self) -> set[str]:
        return {host for host, ranks in self.live_ranks.items() if ranks}

    async def fold_ready(self) -> None:
        """Once the fold (torch) is loaded, off the loop that carries the heartbeats (`FoldLoad`)."""
        if self._barrier is None:
            await self._fold.ready()

    def _ensure_barrier(self) -> RoundBarrier[str]:
        if self._barrier is None:
            # Two accumulators: a relay that has all of a round may start the next one while a send of
            # this round's last chunk to a slower relay still waits to read it (see RoundBarrier). A host's
            # weight drops between chunks when one of its ranks leaves in the middle of its deposit.
            self._barrier = round_barrier(self.live_hosts(), accumulators=2, weights_may_drop=True)
        return self._barrier

    def round_in_progress(self, rank: int) -> int | None:
        """The averaging round `rank` was lost in (`RoundLedger.round_in_progress`); None before any."""
        return self.ledger.round_in_progress(rank, self._barrier.round if self._barrier is not None else None)

    def stats(self) -> DataPlaneStats:
        return DataPlaneStats(
            rounds=self.rounds,
            live_hosts=sorted(self.live_hosts()),
            dead_ranks=list(self.dead_ranks),
            gone_ranks=list(self.gone_ranks),
            refusals=dict(self.refusals),
        )

    # --- channel handlers (the mux hands over after the magic) -----------------------------

    async def handle_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(Channel.DATA, reader, writer)

    async def handle_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(Channel.CONTROL, reader, writer)

    async def _serve(
        self, channel: Channel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        greeted = await self.admission.handshake(channel, reader, writer)
        if greeted is None:
            return
        stream, hello = greeted
        host: str | None = None
        try:
            host = await self.admission.admit(channel, stream, hello)
            if host is None:
                return
            if channel is Channel.DATA:
                stream.read_directly()  # host frames go from the socket straight into their frame buffers
            await serve_frames(
                stream, self._data if channel is Channel.DATA else self._control, _Relay(host, stream)
            )
        except (EOFError, OSError, WireError) as error:
            log.info("event=relay_closed channel=%s host=%s reason=%r", channel.value, host, str(error))
        except Exception as error:  # never a silent handler death: counted, logged, cleaned up below
            self.refusals[f"{channel.value}_failed"] += 1
            log.exception("event=relay_failed channel=%s host=%s reason=%r", channel.value, host, str(error))
        finally:
            # Whatever ended the loop (an unexpected error included), the host's seat and ranks are
            # released here, so the barrier never waits for a host whose handler is gone.
            if host is not None:
                self.admission.release(channel, host, stream)
                if channel is Channel.DATA:
                    for rank in sorted(self.live_ranks[host]):
                        await self._rank_left(host, rank, "its relay's data channel closed")
            stream.close()

    # --- data ------------------------------------------------------------------------------

    async def _on_host_frame(self, message: HostFrame, relay: _Relay, frame: Frame) -> bool:
        """Fold one chunk of a host's partial fold; broadcast every chunk it completes. True on a refusal."""
        conn = relay.stream.conn
        await self.fold_ready()
        try:
            owned = set(self.host_ranks[relay.host])
            if not set(message.contributors) <= owned:
                raise ValueError(
                    f"host {relay.host!r} folded ranks {message.contributors} but owns {sorted(owned)}"
                )
            if self.sole_host:
                raise ValueError(
                    f"host {relay.host!r} is this world's only host: its relay broadcasts its own fold "
                    "(HelloAck sole_host) and sends no host frames"
                )
            barrier = self._ensure_barrier()
            before, late = barrier.round, barrier.late_chunks
            # Folded into the accumulator, the frame's buffer is free again.
            results = barrier.contribute_message(
                relay.host, message, frame.tail_view, lambda: conn.recycle(frame)
            )
        except Exception as error:  # any decode or fold failure is this host's refusal, never a crash
            self.refusals["host_frame"] += 1
            log.error(
                "event=host_frame_refused host=%s reason=%r", relay.host, f"{type(error).__name__}: {error}"
            )
            await self._send_quietly(relay.stream, DataPlaneError(reason=str(error)[:1024]))
            return True
        if barrier.late_chunks != late:  # its round closed without this host (straggler_timeout): dropped
            log.info("event=late_host_frame host=%s round=%d dropped", relay.host, message.round)
            return False
        self.ledger.host_chunk(message.round, message.offset, message.contributors)
        self.metrics.host_chunk(
            message.round, message.offset, message.contributors, frame.tail_view.nbytes, self.clock()
        )
        self.stragglers.arm(barrier, before)
        await self._outbox.send(results, self._broadcast)
        return False

    async def _on_rank_gone(self, message: RankGone, relay: _Relay, frame: Frame) -> None:
        if self.host_of.get(message.rank) == relay.host:
            in_round = self.ledger.left(message.rank, message.round)
            if in_round is not None and self.on_rank_round is not None:
                self.on_rank_round(message.rank, in_round)
            await self._rank_left(relay.host, message.rank, message.reason or "its leg to the relay closed")

    async def _rank_left(self, host: str, rank: int, reason: str, *, dead: bool = False) -> None:
        if self.walk_ins.left_before_entry(host, rank):  # a walk-in's rank gone before it entered
            log.info("event=rank_left host=%s rank=%d before_entry=True reason=%r", host, rank, reason)
            if host in self.walk_ins.entering:
                await self._enter_at_boundary()  # the ranks left may all be connected now
            return
        if rank not in self.live_ranks[host]:
            return
        self.live_ranks[host].discard(rank)
        self.watch.liveness.forget(rank)
        (self.dead_ranks if dead else self.gone_ranks).append(rank)
        if dead:
            self.metrics.rank_dead()
        log.info("event=rank_left host=%s rank=%d dead=%s reason=%r", host, rank, dead, reason)
        if not self.live_ranks[host]:
            results = self._barrier.leave(host) if self._barrier is not None else []
            await self._outbox.send(results, self._broadcast)
            await self._drop_riders(host)

    async def _drop_riders(self, host: str) -> None:
        """Riders still expected on `host`, whose relay's own fold stopped (no rank of it left in the
        averaging), cannot enter there: their relay folds them out and their slots heal again, on relays of
        their own (docs/elastic-averaging.md, "Slots heal in place").
        """
        control = self.relays[Channel.CONTROL].get(host)
        for rider in self.walk_ins.riders_of(host):
            why = f"rank {rider} was to ride host {host!r}'s relay, which has no rank left in the averaging"
            log.info("event=rider_dropped host=%s rank=%d", host, rider)
            self.walk_ins.left_before_entry(host, rider)
            self.watch.liveness.forget(rider)
            if control is not None:
                await self._send_quietly(control, DeclareDead(rank=rider, reason=why))

    async def _broadcast(self, result: ChunkResult[str]) -> None:
        """Finish one completed chunk in place; send it to every live relay, sealed from the accumulator."""
        result.finish()
        contributors = self.ledger.chunk_done(result.offset)
        message = Broadcast(
            round=result.round,
            fold=result.fold_spec,
            weight=result.weight,
            contributors=sorted(contributors),
            tensors=list(result.specs),
            offset=result.offset,
        )
        # Fixed before any await: a walk-in entering meanwhile gets this round as its state, not a chunk.
        live = self.live_hosts()
        recipients = [stream for host, stream in self.relays[Channel.DATA].items() if host in live]
        entered: list[FramedStream] = []
        if result.last:
            self.rounds += 1
            # The walk-ins' state is this round: sealed now, before any await below.
            entered = self.walk_ins.round_closed(result, contributors, self._barrier)
            self.metrics.round_finished(result.round, self.clock())
            # Live ranks whose deposit the round went without: skipped here (their host) or at their
            # relay (the host's frame left them out), by the straggler timeout.
            skipped = self.ledger.round_done(set().union(*self.live_ranks.values()))
            if self.stragglers.clock.timeout is not None:
                for rank in skipped:
                    self.metrics.skipped(rank)
        tail, (kind, payload) = result.byte_views(), encode_message(message)  # sealed per relay, encoded once
        nbytes = sum(view.nbytes for view in tail)
        for stream in recipients:
            with contextlib.suppress(OSError, WireError, TimeoutError):  # as `_send_quietly`
                await stream.send_frame(kind, payload, tail)
            self.metrics.sent(nbytes)
        await self.walk_ins.drain(entered)

    # --- growth: walk-ins enter at a round boundary (WalkIns) ---------------------------------

    async def _on_rank_connected(self, message: RankConnected, relay: _Relay, frame: Frame) -> None:
        """A walk-in's rank is ready to enter: once every one of its host's is, the host enters."""
        if self.walk_ins.rank_connected(relay.host, message.rank):
            await self._enter_at_boundary()

    async def _enter_at_boundary(self) -> None:
        await self.walk_ins.drain(self.walk_ins.at_boundary(self._barrier))

    # --- control ---------------------------------------------------------------------------

    async def _on_heartbeat(self, message: Heartbeat, relay: _Relay, frame: Frame) -> None:
        if self.host_of.get(message.rank) == relay.host:
            gap = self.watch.heard(message.rank)
            self.ledger.heard(message.rank, message.step)
            if self.metrics.heartbeat(message.rank, message.step, gap) and gap is not None:
                self.watch.longest_gap(relay.host, message.rank, gap)

    @staticmethod
    async def _send_quietly(stream: FramedStream, message: Message, tail: Tail = b"") -> None:
        try:
            await stream.send(message, tail)
        except (OSError, WireError, TimeoutError):
            pass
