"""The controller's end of the CPU-reduce data plane and of rank liveness (DATA and CONTROL channels).

One relay per host dials each channel and introduces itself with RelayHello, whose `proof` must verify
under the key derived at that host's admission (`host_key(host)`): a host can speak only as itself.
After HelloAck the connection is rekeyed to that host key. On DATA, host frames
are folded across hosts chunk by chunk (a RoundBarrier over hosts with live ranks); each chunk, finished
as soon as every live host's chunk at that offset is in, goes down as a Broadcast chunk to every relay,
so a large round is pipelined rather than stored and forwarded whole. A world of one host skips these two
hops: the HelloAck on its DATA channel says `sole_host`, its relay broadcasts its own fold to its ranks,
and a host frame arriving here anyway is refused (`rounds` counts only rounds folded here). On CONTROL,
rank heartbeats feed a Liveness table; a coordinator heartbeat goes down every interval, and a rank
silent past the timeout is declared dead: its relay folds it out, and `on_rank_dead` tells the rest of
the controller.

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

from flodld.controller.metrics import RunMetrics
from flodld.fold import round_barrier
from flodld.fold.liveness import Liveness
from flodld.fold.straggler import StragglerClock
from flodld.net.dispatch import serve_frames
from flodld.net.inorder import InOrder
from flodld.net.stream import FramedStream, accept_channel
from flodld.wire.control import CoordinatorHeartbeat, DeclareDead, Heartbeat, Shutdown
from flodld.wire.data import (
    Broadcast,
    DataPlaneError,
    Entry,
    HelloAck,
    HostFrame,
    RankConnected,
    RankGone,
    RelayHello,
)
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame, Tail
from flodld.wire.handlers import HandlerTable
from flodld.wire.hostkey import verify_relay_proof
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

if TYPE_CHECKING:
    from flodld.controller.run import Controller
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.controller.dataplane")

HANDSHAKE_TIMEOUT_SECS = 10.0
DEFAULT_LIVENESS_TIMEOUT_SECS = 30.0
# A run that survives a rank's loss (a tolerance, CPU averaging) declares a silent rank dead sooner: the
# survivors' round waits for it until then, and a false declaration costs one rank, not the run.
DEFAULT_ELASTIC_LIVENESS_TIMEOUT_SECS = 5.0
DEFAULT_HEARTBEAT_INTERVAL_SECS = 1.0
# A rank's first heartbeat waits for its process to start, import the program and torch, and reach its
# relay: on a loaded box that can take far longer than the steady-state timeout, so it gets its own bound.
DEFAULT_LIVENESS_STARTUP_SECS = 120.0

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
        self.salt = salt
        self.host_key = host_key
        # Refused relays and frames by reason; the controller passes its `dropped` counter (state.json,
        # /metrics).
        self.refusals: Counter[str] = refusals if refusals is not None else Counter()
        # Rounds, round times, per-rank delays and reported rounds, tensor bytes (/metrics); the controller
        # passes its run's tally.
        self.metrics = metrics if metrics is not None else RunMetrics()
        self.host_ranks = {host: sorted(ranks) for host, ranks in host_ranks.items()}
        self.host_of = {rank: host for host, ranks in self.host_ranks.items() for rank in ranks}
        self.live_ranks = {host: set(ranks) for host, ranks in self.host_ranks.items()}
        # A world of one host: its relay's fold is the world's, so it broadcasts rounds itself (told so in
        # its DATA HelloAck) and no data frame comes here; liveness and RankGone work as for any world.
        # A run that grows (walk-ins during training) folds here even with one host: a walk-in may join it.
        self.sole_host = len(self.host_ranks) == 1 and not growable
        # Growth (docs/elastic-averaging.md, "Growth and healing"): hosts admitted during training whose ranks
        # have not entered the averaging yet (host -> ranks still expected); they enter at a round boundary
        # once every one of those ranks has connected to its relay (`_connected`, told by RankConnected:
        # the members never wait in a round for a walk-in's start-up), and get the last round's result
        # (`_last_result`: its accumulator holds it until the round after next starts, which waits for the
        # walk-in's deposit).
        self.entering: dict[str, set[int]] = {}
        self._connected: dict[str, set[int]] = {}
        self.on_ranks_entered: Callable[[tuple[int, ...], int], None] | None = None
        self._last_result: ChunkResult[str] | None = None
        self._members_seen: tuple[int, ...] = tuple(sorted(self.host_of))  # as the ranks count epochs
        self._epoch = 0
        self.chunk_env = dict(chunk_env or {})  # FLODL_CHUNK_BYTES as the ranks read it (a walk-in's state)
        # The fold machinery (torch) loads with the first host frame: a run that never averages
        # through the relays never pays for it, and formation is not delayed by the import.
        self._barrier: RoundBarrier[str] | None = None
        self.clock = clock
        self.liveness = Liveness(self.host_of, timeout=liveness_timeout, now=clock(), startup=startup_timeout)
        self.heartbeat_interval = heartbeat_interval
        self.on_rank_dead = on_rank_dead
        self.relays: dict[Channel, dict[str, FramedStream]] = {Channel.DATA: {}, Channel.CONTROL: {}}
        self.rounds = 0
        self._chunk_ranks: dict[int, set[int]] = {}  # ranks in the open chunks of this round, by offset
        self._round_ranks: set[int] = set()  # ranks in the chunks of this round broadcast so far
        # cpu_cadence/cpu_async with a straggler_timeout: a round stops waiting for late hosts after twice
        # the timeout, so that a host whose relay is waiting out its own late rank (the timeout, from its
        # own first deposit) is not skipped with it: the relays skip late ranks, the controller late hosts.
        self.stragglers = StragglerClock(2 * straggler_timeout if straggler_timeout is not None else None)
        self._straggler_timer: asyncio.TimerHandle | None = None
        self._straggler_tasks: set[asyncio.Task[None]] = set()
        self._outbox = InOrder()  # broadcast chunks leave in the order the fold made them
        self.dead_ranks: list[int] = []
        self.gone_ranks: list[int] = []
        self._last_step: dict[int, int] = {}  # each rank's step (rounds it has taken) at its last heartbeat
        self._last_round: dict[int, int] = {}  # the last round a host frame counted each rank in
        self._left_round: dict[int, int] = {}  # the round its relay was in when each rank left (RankGone)
        # Told the round a rank left in, once its relay says (a loss recorded earlier is corrected with it).
        self.on_rank_round: Callable[[int, int], None] | None = None
        self._ticker: asyncio.Task[None] | None = None
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
        for stream in list(self.relays[Channel.CONTROL].values()):
            await self._send_quietly(stream, Shutdown(reason=reason[:1024]))
        await self.close()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    def expect(self, host: str, ranks: Sequence[int]) -> None:
        """A host walked into the training run: its relay may connect, its ranks are watched (with the
        startup grace), and they enter the averaging at a round boundary once its DATA channel is up.
        """
        ranks = sorted(ranks)
        self.host_ranks[host] = ranks
        for rank in ranks:
            self.host_of[rank] = host
        self.live_ranks.setdefault(host, set())
        self.liveness.track(ranks, self.clock())
        self.entering[host] = set(ranks)
        self._connected[host] = set()
        log.info("event=walk_in_expected host=%s ranks=%s", host, ranks)

    def live_hosts(self) -> set[str]:
        return {host for host, ranks in self.live_ranks.items() if ranks}

    def _ensure_barrier(self) -> RoundBarrier[str]:
        if self._barrier is None:
            # Two accumulators: a relay that has all of a round may start the next one while a send of
            # this round's last chunk to a slower relay still waits to read it (see RoundBarrier). A host's
            # weight drops between chunks when one of its ranks leaves in the middle of its deposit.
            self._barrier = round_barrier(self.live_hosts(), accumulators=2, weights_may_drop=True)
        return self._barrier

    def round_in_progress(self, rank: int) -> int | None:
        """The averaging round `rank` was lost in: the round its relay was in when it left (RankGone); else
        the one after the last round its host's frames counted it in (a silent rank's survivors may have
        finished that round without it by now); a rank never counted, the world's round being folded here;
        a sole host's silent rank (its relay folds), its own count of rounds taken at its last heartbeat.
        None before any of these.
        """
        left = self._left_round.get(rank)
        if left is not None:
            return left
        last = self._last_round.get(rank)
        if last is not None:
            return last + 1
        if self._barrier is not None:
            return self._barrier.round
        return self._last_step.get(rank)

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
        try:
            stream = await accept_channel(
                reader, writer, self.salt, channel=channel, timeout=HANDSHAKE_TIMEOUT_SECS
            )
            hello = (await stream.recv(HANDSHAKE_TIMEOUT_SECS)).message()
        except (TimeoutError, EOFError, OSError, WireError) as error:
            self.refusals[f"{channel.value}_handshake"] += 1
            log.info("event=relay_dropped channel=%s reason=%r", channel.value, str(error))
            return
        host: str | None = None
        try:
            host = await self._admit_relay(channel, stream, hello)
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
                if self.relays[channel].get(host) is stream:
                    del self.relays[channel][host]
                if channel is Channel.DATA:
                    for rank in sorted(self.live_ranks[host]):
                        await self._rank_left(host, rank, "its relay's data channel closed")
            stream.close()

    async def _admit_relay(self, channel: Channel, stream: FramedStream, hello: Message) -> str | None:
        if not isinstance(hello, RelayHello):
            await self._refuse(channel, stream, f"expected RelayHello first, got {type(hello).__name__}")
            return None
        refusal = self._refusal(channel, stream, hello)
        if refusal is not None:
            await self._refuse(channel, stream, refusal)
            return None
        key = self.host_key(hello.host)
        assert key is not None  # checked by _proves_host_key
        self.relays[channel][hello.host] = stream
        try:
            await stream.send(HelloAck(sole_host=channel is Channel.DATA and self.sole_host))
        except BaseException:
            del self.relays[channel][hello.host]
            raise
        stream.rekey(key)  # every later frame in both directions is authenticated as this host's
        log.info(
            "event=relay_joined channel=%s host=%s ranks=%s", channel.value, hello.host, sorted(hello.ranks)
        )
        return hello.host

    async def _refuse(self, channel: Channel, stream: FramedStream, refusal: str) -> None:
        self.refusals[f"{channel.value}_hello"] += 1
        log.warning("event=relay_refused channel=%s reason=%r", channel.value, refusal)
        await self._send_quietly(stream, DataPlaneError(reason=refusal))

    def _refusal(self, channel: Channel, stream: FramedStream, hello: RelayHello) -> str | None:
        """Why this relay's hello is refused, or None (the decision; `_admit_relay` acts on it)."""
        if hello.host not in self.host_ranks:
            return f"host {hello.host!r} is not in this world (hosts: {sorted(self.host_ranks)})"
        if not self._proves_host_key(channel, stream, hello):
            return (
                f"the relay's hello for host {hello.host!r} does not verify under that host's admission key: "
                "a relay speaks only for the host whose agent started it"
            )
        if sorted(hello.ranks) != self.host_ranks[hello.host]:
            owned = self.host_ranks[hello.host]
            return f"host {hello.host!r} claims ranks {sorted(hello.ranks)} but owns {owned}"
        if hello.host in self.relays[channel]:
            return f"host {hello.host!r} already has a relay on the {channel} channel"
        return None

    def _proves_host_key(self, channel: Channel, stream: FramedStream, hello: RelayHello) -> bool:
        key = self.host_key(hello.host)
        listener_nonce, dialer_nonce = stream.conn.nonce, stream.conn.peer_nonce
        if key is None or dialer_nonce is None:
            return False
        return verify_relay_proof(
            key,
            hello.proof,
            host=hello.host,
            channel=channel,
            dialer_nonce=dialer_nonce,
            listener_nonce=listener_nonce,
        )

    # --- data ------------------------------------------------------------------------------

    async def _on_host_frame(self, message: HostFrame, relay: _Relay, frame: Frame) -> bool:
        """Fold one chunk of a host's partial fold; broadcast every chunk it completes. True on a refusal."""
        conn = relay.stream.conn
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
        self._chunk_ranks.setdefault(message.offset, set()).update(message.contributors)
        for rank in message.contributors:
            self._last_round[rank] = message.round
        self.metrics.host_chunk(
            message.round, message.offset, message.contributors, frame.tail_view.nbytes, self.clock()
        )
        self._watch_stragglers(barrier, before)
        await self._outbox.send(results, self._broadcast)
        return False

    def _watch_stragglers(self, barrier: RoundBarrier[str], before: int) -> None:
        """After a host's chunk was taken: the round still open at `before` starts its straggler clock."""
        if self.stragglers.timeout is None or barrier.round != before or not barrier.started:
            return
        if self.stragglers.wake_at(before) is None:
            self.stragglers.opened(before, self.clock())
            wake = self.stragglers.wake_at(before)
            assert wake is not None
            if self._straggler_timer is not None:
                self._straggler_timer.cancel()
            self._straggler_timer = asyncio.get_running_loop().call_later(
                max(0.0, wake - self.clock()), self._stragglers_due, before
            )

    def _stragglers_due(self, round_number: int) -> None:
        """The timer: skip the hosts that still owe `round_number`, if it is still open."""
        self._straggler_timer = None
        barrier = self._barrier
        late = self.stragglers.late(barrier, round_number, self.clock())
        if barrier is None or late is None:
            return
        log.warning(
            "event=round_skipped_hosts round=%d hosts=%s timeout=%g",
            round_number,
            late,
            self.stragglers.timeout,
        )
        sending = self._outbox.send(barrier.skip(late), self._broadcast)
        task = asyncio.get_running_loop().create_task(sending)
        self._straggler_tasks.add(task)
        task.add_done_callback(self._straggler_tasks.discard)

    async def _on_rank_gone(self, message: RankGone, relay: _Relay, frame: Frame) -> None:
        if self.host_of.get(message.rank) == relay.host:
            if message.round is not None and message.rank not in self._left_round:
                self._left_round[message.rank] = message.round
                if self.on_rank_round is not None:
                    self.on_rank_round(message.rank, message.round)
            await self._rank_left(relay.host, message.rank, message.reason or "its leg to the relay closed")

    async def _rank_left(self, host: str, rank: int, reason: str, *, dead: bool = False) -> None:
        pending = self.entering.get(host)
        if pending is not None and rank in pending:  # a walk-in's rank gone before it entered
            pending.discard(rank)
            if not pending:
                del self.entering[host]
                self._connected.pop(host, None)
            log.info("event=rank_left host=%s rank=%d before_entry=True reason=%r", host, rank, reason)
            if pending:
                await self._enter_at_boundary()  # the ranks left may all be connected now
            return
        if rank not in self.live_ranks[host]:
            return
        self.live_ranks[host].discard(rank)
        self.liveness.forget(rank)
        (self.dead_ranks if dead else self.gone_ranks).append(rank)
        if dead:
            self.metrics.rank_dead()
        log.info("event=rank_left host=%s rank=%d dead=%s reason=%r", host, rank, dead, reason)
        if not self.live_ranks[host]:
            results = self._barrier.leave(host) if self._barrier is not None else []
            await self._outbox.send(results, self._broadcast)

    async def _broadcast(self, result: ChunkResult[str]) -> None:
        """Finish one completed chunk in place; send it to every live relay, sealed from the accumulator."""
        result.finish()
        contributors = self._chunk_ranks.pop(result.offset, set())
        self._round_ranks |= contributors
        message = Broadcast(
            round=result.round,
            fold=result.fold_spec,
            weight=result.weight,
            contributors=sorted(contributors),
            tensors=list(result.specs),
            offset=result.offset,
        )
        # Fixed before any await: a walk-in entering meanwhile gets this round as its state, not a chunk.
        recipients = [
            (host, stream) for host, stream in self.relays[Channel.DATA].items() if host in self.live_hosts()
        ]
        entered: list[FramedStream] = []
        if result.last:
            self.rounds += 1
            self._chunk_ranks.clear()
            self._last_result = result
            members = tuple(sorted(contributors))
            if members and members != self._members_seen:  # the ranks' own epoch count, replayed here
                self._epoch += 1
                self._members_seen = members
            # The walk-ins' state is this round: sealed now, before any await below.
            entered = [
                stream
                for host in self._enter_now(result.round + 1)
                if (stream := self._seal_entry(host, result.round + 1)) is not None
            ]
            self.metrics.round_finished(result.round, self.clock())
            if self.stragglers.timeout is not None:
                # Live ranks whose deposit the round went without: skipped here (their host) or at their
                # relay (the host's frame left them out), by the straggler timeout.
                live = set().union(*self.live_ranks.values())
                for rank in sorted(live - self._round_ranks):
                    self.metrics.skipped(rank)
            self._round_ranks = set()
        tail = result.byte_views()
        nbytes = sum(view.nbytes for view in tail)
        for _, stream in recipients:
            await self._send_quietly(stream, message, tail)
            self.metrics.sent(nbytes)
        await self._drain_entries(entered)

    # --- growth: walk-ins enter at a round boundary ------------------------------------------

    def _enter_now(self, round_number: int) -> list[str]:
        """Let every walk-in whose relay's DATA channel is up into the averaging from `round_number`, the
        round that has not started (the caller is at its boundary). Returns the hosts that entered.
        """
        ready = [
            host
            for host in sorted(self.entering)
            if host in self.relays[Channel.DATA] and self.entering[host] <= self._connected.get(host, set())
        ]
        if not ready:
            return []
        barrier = self._barrier
        if barrier is not None and (barrier.started or barrier.round != round_number):
            return []  # past the boundary already: the next one
        entered = []
        for host in ready:
            ranks = self.entering.pop(host)
            self._connected.pop(host, None)
            if barrier is not None:
                barrier.admit(host)
            self.live_ranks[host] = set(ranks)
            entered.append(host)
            log.info("event=walk_in_entered host=%s ranks=%s round=%d", host, sorted(ranks), round_number)
            if self.on_ranks_entered is not None:
                self.on_ranks_entered(tuple(sorted(ranks)), round_number)
        return entered

    async def _on_rank_connected(self, message: RankConnected, relay: _Relay, frame: Frame) -> None:
        """A walk-in's rank connected to its relay: once every one of its host's has, the host enters."""
        pending = self.entering.get(relay.host)
        if pending is None or message.rank not in pending:
            return  # not a walk-in's rank waiting to enter (one gone already, or a late word)
        self._connected.setdefault(relay.host, set()).add(message.rank)
        if pending <= self._connected[relay.host]:
            log.info("event=walk_in_ready host=%s ranks=%s", relay.host, sorted(pending))
            await self._enter_at_boundary()

    async def _enter_at_boundary(self) -> None:
        """A walk-in's ranks are connected to its relay: it enters now if the world is at a round boundary
        whose state is at hand (no round started; the last round's result still held), else at the end of
        the round in progress.
        """
        barrier = self._barrier
        if barrier is None:
            next_round = 0  # nothing folded here yet: it enters the first round, with no state
        elif barrier.started:
            return
        else:
            next_round = barrier.round
            last = self._last_result
            if next_round > 0 and (last is None or last.round != next_round - 1):
                return  # the round before closed without a value: no state to hand over yet
        sealed = [self._seal_entry(host, next_round) for host in self._enter_now(next_round)]
        await self._drain_entries([stream for stream in sealed if stream is not None])

    async def _drain_entries(self, streams: list[FramedStream]) -> None:
        for stream in streams:
            try:
                await stream.drain()
            except (OSError, WireError, TimeoutError) as error:
                log.warning("event=walk_in_state_unsent error=%r", str(error))

    def _seal_entry(self, host: str, round_number: int) -> FramedStream | None:
        """Entry to a walk-in's relay, then (when a round was completed before) that round's result: the
        finished accumulator in chunks of the run's chunk size, the bytes every member received. Sealed
        here, without an await: no broadcast can come between them, and the accumulator may be reused as
        soon as this returns (by a round the walk-in is skipped in, under a straggler timeout). Returns the
        stream to drain.
        """
        stream = self.relays[Channel.DATA].get(host)
        if stream is None:
            return None
        members = tuple(sorted(set().union(*self.live_ranks.values())))
        epoch = self._epoch + (members != self._members_seen)
        last = self._last_result if round_number > 0 else None
        state = last is not None and last.round == round_number - 1
        try:
            stream.send_nowait(Entry(round=round_number, epoch=epoch, members=list(members), state=state))
            if state:
                assert last is not None
                from flodld.fold.chunks import Layout, byte_views, chunk_bytes_from_env  # torch: in by now

                layout = Layout(last.specs)
                chunk_bytes = max(chunk_bytes_from_env(self.chunk_env), max(layout.itemsizes, default=1))
                contributors = sorted(self._members_seen)
                for offset, length in layout.ranges(chunk_bytes):
                    chunk = Broadcast(
                        round=last.round,
                        fold=last.fold_spec,
                        weight=last.weight,
                        contributors=contributors,
                        tensors=list(last.specs),
                        offset=offset,
                    )
                    stream.send_nowait(chunk, byte_views(last.tensors, layout.pieces(offset, length)))
                    self.metrics.sent(length)
        except (OSError, WireError) as error:
            log.warning("event=walk_in_state_unsent host=%s error=%r", host, str(error))
            return None
        return stream

    # --- control ---------------------------------------------------------------------------

    async def _on_heartbeat(self, message: Heartbeat, relay: _Relay, frame: Frame) -> None:
        if self.host_of.get(message.rank) == relay.host:
            self.liveness.heard(message.rank, self.clock())
            self._last_step[message.rank] = message.step
            self.metrics.heartbeat(message.rank, message.step)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self.tick()

    async def tick(self) -> None:
        """One coordinator beat: heartbeat every relay, declare silent ranks dead."""
        for stream in list(self.relays[Channel.CONTROL].values()):
            await self._send_quietly(stream, CoordinatorHeartbeat())
        for rank, silence in self.liveness.expire_with_limits(self.clock()):
            host = self.host_of[rank]
            in_round = self.round_in_progress(rank)
            during = f" (round {in_round} in progress)" if in_round is not None else ""
            reason = f"rank {rank} on {host!r} sent no heartbeat for {silence:g}s{during}"
            log.warning("event=rank_declared_dead host=%s rank=%d", host, rank)
            control = self.relays[Channel.CONTROL].get(host)
            if control is not None:
                await self._send_quietly(control, DeclareDead(rank=rank, reason=reason))
            await self._rank_left(host, rank, reason, dead=True)
            if self.on_rank_dead is not None:
                try:
                    self.on_rank_dead(rank, reason)
                except Exception:  # a failing listener must not stop the heartbeat ticker
                    log.exception("event=rank_dead_listener_failed rank=%d", rank)

    @staticmethod
    async def _send_quietly(stream: FramedStream, message: Message, tail: Tail = b"") -> None:
        try:
            await stream.send(message, tail)
        except (OSError, WireError, TimeoutError):
            pass


def attach_data_plane(controller: Controller, *, environ: Mapping[str, str] | None = None) -> None:
    """Serve DATA/CONTROL for `controller`'s run: built when the world forms, shut down when it ends.

    Timeouts come from FLODL_LIVENESS_TIMEOUT_SECS / FLODL_HEARTBEAT_INTERVAL_SECS in the run's env
    (the same values the ranks read), else the environment, scaled by FLODL_NET_TIMEOUT_SCALE; a rank
    never heard from gets FLODL_LIVENESS_STARTUP_SECS (120 s, scaled, at least the timeout) to start.
    A rank declared dead goes to `controller.rank_lost`: its host is lost and the run fails beyond
    the tolerance, the reason naming rank and silence. A run that survives a rank's loss
    (`controller.survives_rank_loss`) declares a silent rank dead after 5 s by default instead of 30 s.
    """
    import os

    from flodld.membership.phase import TERMINAL_PHASES
    from flodld.net.timeouts import scaled

    source = {**(environ if environ is not None else os.environ), **controller.options.env}

    def seconds(name: str, default: float) -> float:
        raw = source.get(name)
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
        return value if name == "FLODL_HEARTBEAT_INTERVAL_SECS" else scaled(value)

    # Read (and refused if malformed) now; which default applies is known once the world formed (a
    # tolerance given as a share of the world is a count only then).
    timeouts = {
        elastic: seconds("FLODL_LIVENESS_TIMEOUT_SECS", default)
        for elastic, default in (
            (False, DEFAULT_LIVENESS_TIMEOUT_SECS),
            (True, DEFAULT_ELASTIC_LIVENESS_TIMEOUT_SECS),
        )
    }
    startup_secs = seconds("FLODL_LIVENESS_STARTUP_SECS", DEFAULT_LIVENESS_STARTUP_SECS)
    interval = seconds("FLODL_HEARTBEAT_INTERVAL_SECS", DEFAULT_HEARTBEAT_INTERVAL_SECS)
    planes: list[DataPlane] = []

    def on_phase(phase: object, reason: str) -> None:
        window = controller.window
        if (
            not planes
            and window is not None
            and window.world is not None
            and controller.options.cpu_averaging
        ):
            liveness = timeouts[controller.survives_rank_loss]
            startup = max(liveness, startup_secs)
            plane = DataPlane(
                controller.salt,
                dict(window.world.ranks),
                host_key=controller.host_key,
                refusals=controller.counters.dropped,
                liveness_timeout=liveness,
                startup_timeout=startup,
                heartbeat_interval=interval,
                on_rank_dead=controller.rank_lost,  # a silent rank fails the run beyond the tolerance
                metrics=controller.run_metrics,
                straggler_timeout=controller.options.straggler_timeout,
                growable=controller.options.growable,
                chunk_env={key: source[key] for key in ("FLODL_CHUNK_BYTES",) if key in source},
            )
            controller.register_channels(
                {Channel.DATA: plane.handle_data, Channel.CONTROL: plane.handle_control}
            )
            plane.start()
            planes.append(plane)
            controller.round_in_progress = plane.round_in_progress
            plane.on_rank_round = controller.rank_round
            controller.expect_walk_in = plane.expect
            plane.on_ranks_entered = controller.ranks_entered
        if planes and phase in TERMINAL_PHASES:
            task = asyncio.get_running_loop().create_task(planes[0].close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)

    controller.on_phase(on_phase)


_closing: set[asyncio.Task[None]] = set()
