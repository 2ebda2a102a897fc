"""The relay: one per host, between the local ranks (loopback legs) and the controller (two upstreams).

Data: ranks deposit in chunks, the barrier folds each chunk of all live local deposits and sends it up
as a HostFrame chunk as soon as it is complete (pipelined, never a whole large frame stored first), and
the controller's Broadcast chunks are fanned out to the live ranks as they come. When the controller's
HelloAck says this is the world's only host (`sole_host`), the relay's fold is the world's: it finishes
each complete chunk itself and broadcasts it straight back to its ranks (no data frame goes to the
controller; RankGone still does, and liveness runs on CONTROL as always). Control: heartbeats up,
coordinator heartbeats / shutdown down, DeclareDead folds a rank out. A rank's leg closing folds it out
(RankGone up). The relay ends when every rank is gone, when the controller goes away, or on TERM.

Its parts: the loopback listener and the legs' pre-authentication (`flodld.relay.listener`), the
upstreams (`flodld.relay.upstream`), the ranks' shared-memory regions (`flodld.relay.regions`), the
straggler clock (`flodld.relay.stragglers`) and a walk-in's entry (`flodld.relay.entry`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from flodld.fold import round_barrier
from flodld.net.dispatch import serve_frames
from flodld.net.inorder import InOrder
from flodld.net.shm import ShmError
from flodld.net.stream import FramedStream
from flodld.relay.delivery import Delivery, send_quietly
from flodld.relay.entry import WalkInEntry
from flodld.relay.listener import RankListener, leg_end_level
from flodld.relay.regions import RankRegions
from flodld.relay.spec import RelayRoleSpec
from flodld.relay.stragglers import StragglerWatch
from flodld.relay.upstream import dial_controller
from flodld.wire.control import CoordinatorHeartbeat, DeclareDead, Heartbeat, Shutdown
from flodld.wire.data import (
    Broadcast,
    DataPlaneError,
    Deposit,
    Entry,
    HelloAck,
    HostFrame,
    RankConnected,
    RankGone,
    RankHello,
    ShmAccepted,
    ShmDeposit,
    ShmOffer,
    ShmRefused,
)
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.handlers import HandlerTable
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.relay")


@dataclass(frozen=True)
class _Leg:
    """Who a rank leg's frames come from (the context of the leg's dispatch table)."""

    rank: int
    stream: FramedStream


ChunkMessage = TypeVar("ChunkMessage", HostFrame, Broadcast)


def chunk_message(kind: type[ChunkMessage], result: ChunkResult[int]) -> ChunkMessage:
    """The header of a completed chunk, as a HostFrame (up) or a Broadcast (to the ranks)."""
    return kind(
        round=result.round,
        fold=result.fold_spec,
        weight=result.weight,
        contributors=sorted(result.contributors),
        tensors=list(result.specs),
        offset=result.offset,
    )


class Relay:
    def __init__(self, spec: RelayRoleSpec) -> None:
        self.spec = spec
        self.salt = bytes.fromhex(spec.salt_hex)
        self.host_key = bytes.fromhex(spec.host_key_hex)
        self.ranks = sorted(spec.ranks)
        # Folding needs torch; it loads with the first deposit, so a run that only uses the relay for
        # liveness (gloo/nccl collectives) starts its relay without the import.
        self._barrier: RoundBarrier[int] | None = None
        # The world's only host (the controller says so in its DATA HelloAck): fold and broadcast here.
        self.sole_host = False
        self._failed_round: str | None = None  # why the sole host's fold could not finish a round
        # Completed chunks leave in the order the fold made them, whichever task made them.
        self._outbox = InOrder()
        # cpu_cadence/cpu_async with a straggler_timeout: when a round stops waiting for its late ranks.
        self._stragglers = StragglerWatch(
            spec.straggler_timeout,
            ship=lambda results: self._outbox.send(results, self._ship),
            failed=lambda why: self._stop(why, 1),
        )
        self.legs: dict[Channel, dict[int, FramedStream]] = {Channel.DATA: {}, Channel.CONTROL: {}}
        self.gone: set[int] = set()
        self.upstream: dict[Channel, FramedStream] = {}
        self.finished = asyncio.Event()
        self.exit_code = 0
        self.rounds = 0
        self.refused = 0
        self._warned_cleartext = False
        # The loopback listener for ranks: legs reach `_serve_leg` with a hello, pre-authenticated.
        self.listener = RankListener(len(self.ranks), self.salt, self._serve_leg)
        self._rank_data: HandlerTable[[_Leg, Frame], Awaitable[bool | None]] = HandlerTable("rank data frame")
        self._rank_data.register(Deposit, self._on_deposit)
        self._rank_data.register(ShmOffer, self._on_shm_offer)
        self._rank_data.register(ShmDeposit, self._on_shm_deposit)
        self.shm = RankRegions()
        self.down = Delivery(self.legs, self.shm, self._stopped_reading)
        self._rank_control: HandlerTable[[_Leg, Frame], Awaitable[bool | None]] = HandlerTable(
            "rank control frame"
        )
        self._rank_control.register(Heartbeat, self._on_heartbeat)
        self._from_controller: HandlerTable[[FramedStream, Frame], Awaitable[bool | None]] = HandlerTable(
            "controller frame"
        )
        self._from_controller.register(Broadcast, self._on_broadcast)
        self._from_controller.register(CoordinatorHeartbeat, self._on_coordinator_word)
        self._from_controller.register(Shutdown, self._on_coordinator_word)
        self._from_controller.register(DeclareDead, self._on_declare_dead)
        self._from_controller.register(DataPlaneError, self._on_refused)
        self._from_controller.register(Entry, self._on_entry)
        # A walk-in (docs/elastic-averaging.md, "Growth and healing"): its entry round and state.
        self.entry = WalkInEntry(spec.walk_in, self.ranks, self.gone)

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        """Dial both upstreams, serve the ranks, return the process exit code."""
        for channel in (Channel.DATA, Channel.CONTROL):
            self.upstream[channel] = await self._dial(channel)
        listener = socket.socket(fileno=self.spec.listen_fd)
        server = await asyncio.get_running_loop().create_server(self.listener.protocol, sock=listener)
        log.info(
            "relay: host %r ranks %s -> controller %s:%d",
            self.spec.host,
            self.ranks,
            self.spec.controller_host,
            self.spec.controller_port,
        )
        readers = [
            asyncio.create_task(self._read_upstream(Channel.DATA)),
            asyncio.create_task(self._read_upstream(Channel.CONTROL)),
        ]
        await self.finished.wait()
        server.close()
        for task in readers:
            task.cancel()
        for legs in self.legs.values():
            for leg in legs.values():
                leg.close()
        self.shm.retire_all()
        for stream in self.upstream.values():
            await stream.aclose()
        log.info(
            "relay: host %r shut down after %d round(s) (exit %d)",
            self.spec.host,
            self.rounds,
            self.exit_code,
        )
        return self.exit_code

    def stop(self, why: str, code: int) -> None:
        """End the relay (closes every leg); `code` becomes its exit code."""
        self._stop(why, code)

    def _stop(self, why: str, code: int) -> None:
        if not self.finished.is_set():
            log.info("relay: stopping: %s", why)
            self.exit_code = code
            self.finished.set()

    async def _dial(self, channel: Channel) -> FramedStream:
        stream, ack, warned = await dial_controller(
            self.spec, channel, host_key=self.host_key, warn_public=not self._warned_cleartext
        )
        self._warned_cleartext = self._warned_cleartext or warned
        if channel is Channel.DATA:
            self.sole_host = ack.sole_host
            if self.sole_host:
                log.info("relay: host %r is the world's only host: rounds are broadcast here", self.spec.host)
            stream.read_directly()  # broadcasts go from the socket straight into their frame buffers
        return stream

    def _ensure_barrier(self) -> RoundBarrier[int]:
        if self._barrier is None:
            # A sole host broadcasts from its accumulator as the controller does, so it keeps two (a rank
            # that has all of a round may deposit the next while a send to a slower rank still reads it).
            live = set(self.ranks) - self.gone
            self._barrier = round_barrier(live, accumulators=2 if self.sole_host else 1)
            if self.entry.entry is not None:
                self._barrier.begin_at(self.entry.entry.round)
        return self._barrier

    # --- ranks -----------------------------------------------------------------------------

    async def _serve_leg(self, channel: Channel, stream: FramedStream, hello: Message) -> None:
        """A pre-authenticated leg (`flodld.relay.listener`): its hello checked, then its frames served."""
        refusal = (
            self._check_rank_hello(channel, hello)
            if isinstance(hello, RankHello)
            else f"expected RankHello on a {channel} leg, got {type(hello).__name__}"
        )
        if refusal is not None or not isinstance(hello, RankHello):
            log.warning("relay: %s", refusal)
            await send_quietly(stream, DataPlaneError(reason=refusal or "no RankHello"))
            stream.close()
            return
        rank = hello.rank
        self.legs[channel][rank] = stream
        try:
            await stream.send(HelloAck())
            if channel is Channel.DATA and self.entry.walk_in and self.entry.entry is None:
                # The controller lets a walk-in in once every rank of it is here to take the state.
                try:
                    await self.upstream[Channel.DATA].send(RankConnected(rank=rank))
                except (OSError, WireError) as error:
                    self._stop(f"controller data channel failed: {error}", 1)
                    raise
            if channel is Channel.DATA and self.entry.owed(rank):
                await self._hand_entry({rank: stream})
            if channel is Channel.DATA:
                stream.read_directly()  # deposits go from the socket straight into their frame buffers
            leg = _Leg(rank, stream)
            if channel is Channel.DATA:
                await serve_frames(stream, self._rank_data, leg, unhandled=self._unexpected_on_data_leg)
            else:
                await serve_frames(stream, self._rank_control, leg)
        except (EOFError, OSError, WireError) as error:
            if rank not in self.gone:
                log.log(leg_end_level(error), "relay: rank %d %s leg closed (%s)", rank, channel, error)
        except Exception:
            log.exception("relay: rank %d %s leg failed", rank, channel)
        finally:
            # Always fold the rank out, whatever ended its leg: the barrier must not wait for it.
            await self._rank_gone(rank, f"rank {rank} closed its {channel} leg", notify_upstream=True)

    def _check_rank_hello(self, channel: Channel, hello: RankHello) -> str | None:
        """Why this rank's hello is refused, or None."""
        if hello.rank not in self.ranks:
            return f"rank {hello.rank} is not one of this host's ranks {self.ranks}"
        if hello.rank in self.gone:
            return f"rank {hello.rank} already left this run"
        if hello.rank in self.legs[channel]:
            return f"rank {hello.rank} opened a second {channel} leg"
        return None

    async def _on_deposit(self, message: Deposit, leg: _Leg, frame: Frame) -> bool:
        """Fold one chunk of a rank's deposit; ship every chunk it completes. True (stop) on a refusal."""
        # Folded into the accumulator, the frame's buffer is free again.
        return await self._fold(
            leg, message, lambda: (frame.tail_view, functools.partial(leg.stream.conn.recycle, frame))
        )

    async def _on_shm_deposit(self, message: ShmDeposit, leg: _Leg, frame: Frame) -> bool:
        """Fold a chunk straight from the rank's region, as `_on_deposit` folds a framed one."""

        def lend() -> tuple[memoryview, Callable[[], None]]:
            region = self.shm.regions.get(leg.rank)
            if region is None:
                raise ShmError("a shared-memory deposit without an accepted region")
            data = region.data(message.offset, message.length)
            region.lend()
            return data, region.give_back

        return await self._fold(leg, message, lend)

    async def _fold(
        self,
        leg: _Leg,
        message: Deposit | ShmDeposit,
        take: Callable[[], tuple[memoryview, Callable[[], None]]],
    ) -> bool:
        """Fold a chunk of `leg`'s deposit (its bytes and their release from `take`); ship every chunk it
        completes. Any decode or fold failure refuses this rank, never kills the relay: True, the leg stops.
        """
        barrier = self._ensure_barrier()
        if self._failed_round is not None:
            await send_quietly(leg.stream, DataPlaneError(reason=self._failed_round))
            return True
        release: Callable[[], None] | None = None
        try:
            data, release = take()
            before = barrier.round
            results = barrier.contribute_message(leg.rank, message, data, release)
        except Exception as error:
            if release is not None:
                release()  # nothing of the chunk was kept: the region's loan or the frame's buffer is free
            self.refused += 1
            log.error("relay: refusing rank %d: %s: %s", leg.rank, type(error).__name__, error)
            await send_quietly(leg.stream, DataPlaneError(reason=str(error)[:1024]))
            return True
        if isinstance(message, ShmDeposit) and message.round >= before:
            self.shm.deposited(leg.rank, message.round)  # a late chunk's round was delivered framed already
        self._stragglers.watch(barrier, before, leg.rank)
        await self._outbox.send(results, self._ship)
        return False

    async def _on_shm_offer(self, message: ShmOffer, leg: _Leg, frame: Frame) -> None:
        """Map and check the rank's region (flodld.net.shm), or refuse it: the leg goes on framed."""
        if not self.shm.enabled:
            await leg.stream.send(ShmRefused(reason="shared memory is off on this relay (FLODL_SHM=off)"))
            return
        try:
            region = self.shm.map(message, leg.stream.writer)
        except ShmError as error:
            self.refused += 1
            log.warning("relay: refused rank %d's shared memory offer: %s", leg.rank, error)
            await leg.stream.send(ShmRefused(reason=str(error)[:1024]))
            return
        if leg.rank in self.gone:  # pragma: no cover - a gone rank's leg is closed before its next frame
            self.shm.forget(leg.rank)
            region.retire()
            return
        self.shm.keep(leg.rank, region)
        # The region's size is the rounds' to come: fault in their accumulator now, not chunk by chunk.
        if region.populated:  # the rank made its pages: its rounds are that big
            self._ensure_barrier().prepare(region.capacity)
        await leg.stream.send(ShmAccepted(size=message.size))

    async def _unexpected_on_data_leg(self, message: Message, leg: _Leg) -> bool:
        raise WireError("bad_payload", f"rank {leg.rank} sent {type(message).__name__} on its data leg")

    async def _on_heartbeat(self, message: Heartbeat, leg: _Leg, frame: Frame) -> None:
        if message.rank == leg.rank:
            await self.upstream[Channel.CONTROL].send(message)

    async def _stopped_reading(self, rank: int, channel: Channel) -> None:
        await self._rank_gone(rank, f"rank {rank} stopped reading its {channel} leg", notify_upstream=True)

    async def _rank_gone(self, rank: int, reason: str, *, notify_upstream: bool) -> None:
        if rank in self.gone:
            return
        self.gone.add(rank)
        for legs in self.legs.values():
            leg = legs.pop(rank, None)
            if leg is not None:
                leg.close()
        self.shm.forget(rank)
        in_round = self._barrier.round if self._barrier is not None else None  # before the leave completes it
        results = self._barrier.leave(rank) if self._barrier is not None else []
        try:
            await self._outbox.send(results, self._ship)
            if notify_upstream:
                gone = RankGone(rank=rank, reason=reason[:1024], round=in_round)
                await self.upstream[Channel.DATA].send(gone)
        except (OSError, WireError) as error:
            self._stop(f"controller data channel failed: {error}", 1)
            return
        if self.gone >= set(self.ranks):
            self._stop("every local rank has left", 0)

    async def _ship(self, result: ChunkResult[int]) -> None:
        """One completed chunk up, sealed straight from the accumulator (scatter views, no copy first);
        on the world's only host, finished and broadcast to the ranks instead.
        """
        if self.sole_host:
            await self._broadcast_here(result)
            return
        await self.upstream[Channel.DATA].send(chunk_message(HostFrame, result), result.byte_views())

    async def _broadcast_here(self, result: ChunkResult[int]) -> None:
        """The sole host's completed chunk is the world's: finish it in place (what the controller would
        do) and seal it from the accumulator into every live rank's leg. A fold that cannot finish (a mean
        of total weight zero) is every rank's verdict: each gets the DataPlaneError, and later deposits too.
        """
        if self._failed_round is not None:
            return
        try:
            result.finish()
        except Exception as error:  # FoldError: the round has no value to broadcast
            self.refused += 1
            self._failed_round = f"round {result.round} cannot be finished: {error}"[:1024]
            log.error("relay: %s", self._failed_round)
            await self.down.tell_quietly(DataPlaneError(reason=self._failed_round))
            return
        if result.offset == 0:
            self.rounds += 1
        await self.down.deliver(chunk_message(Broadcast, result), result.byte_views())

    # --- controller ------------------------------------------------------------------------

    async def _read_upstream(self, channel: Channel) -> None:
        stream = self.upstream[channel]
        try:
            await serve_frames(stream, self._from_controller, stream)
        except (EOFError, OSError, WireError) as error:
            live = set(self.ranks) - self.gone
            self._stop(
                f"controller {channel} channel closed ({error}) with ranks {sorted(live)} live",
                1 if live else 0,
            )
        except Exception:
            log.exception("relay: controller %s reader failed", channel)
        finally:
            if not self.finished.is_set():  # an unexpected error must end the relay, not leave it hanging
                self._stop(f"controller {channel} reader ended unexpectedly", 1)

    # --- growth: a walk-in's entry (docs/elastic-averaging.md, "Growth and healing") -----------------

    async def _on_entry(self, message: Entry, stream: FramedStream, frame: Frame) -> bool:
        """The controller lets this walk-in's ranks in at `message.round`; the state chunks follow."""
        why = self.entry.enter(message, self._barrier)
        if why is not None:
            self._stop(why, 1)
            return True
        log.info("relay: host %r enters the averaging at round %d", self.spec.host, message.round)
        if self.entry.complete:  # no state to wait for
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _take_state(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool:
        """A chunk of the walk-in's state (round `entry.round - 1`): kept, in order, until it is whole."""
        why = self.entry.take(message, frame.tail_view)
        if why is not None:
            self._stop(why, 1)
            return True
        stream.conn.recycle(frame)
        if self.entry.complete:
            log.info("relay: host %r has the state of round %d (%d bytes)", self.spec.host, message.round,
                     self.entry.state_bytes)  # fmt: skip
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _hand_entry(self, legs: dict[int, FramedStream]) -> None:
        await self.entry.hand(legs, functools.partial(self._stopped_reading, channel=Channel.DATA))

    async def _on_broadcast(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool | None:
        if self.entry.taking_state:
            return await self._take_state(message, stream, frame)
        if message.offset == 0:
            self.rounds += 1
        self._stragglers.closed_above(self._barrier, message, frame.tail_view.nbytes)
        await self.down.deliver(message, [frame.tail_view])
        stream.conn.recycle(frame)  # sealed into every leg's frame: its buffer is free
        return None

    async def _on_coordinator_word(
        self, message: CoordinatorHeartbeat | Shutdown, stream: FramedStream, frame: Frame
    ) -> None:
        await self.down.fan_out(Channel.CONTROL, message, b"")

    async def _on_declare_dead(self, message: DeclareDead, stream: FramedStream, frame: Frame) -> None:
        log.warning("relay: controller declared rank %d dead: %s", message.rank, message.reason)
        await self._rank_gone(message.rank, message.reason, notify_upstream=False)

    async def _on_refused(self, message: DataPlaneError, stream: FramedStream, frame: Frame) -> bool:
        self._stop(f"controller refused this host's data: {message.reason}", 1)
        return True


def run_relay() -> int:
    """Entry of the relay role: read the spec from the environment, serve until done."""
    from flodld.relay.spec import relay_spec_from_env

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    relay = Relay(relay_spec_from_env())

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            # TERM is how the agent says "your ranks are done": a clean stop, not a failure.
            loop.add_signal_handler(signum, relay.stop, f"signal {signum.name}", 0)
        try:
            return await relay.run()
        finally:
            # The relay often stops on its own (every rank left) just as the agent's TERM arrives. Left to
            # asyncio.run, the loop closes its self-pipe before it removes its handlers, and a TERM in between
            # makes the C handler write to a closed wakeup fd ("Exception ignored when trying to write to the
            # signal wakeup fd ... Bad file descriptor"), or, just after, kills the exiting relay. The stop is
            # under way: detach from the loop now and ignore further stop signals.
            for signum in signals:
                loop.remove_signal_handler(signum)
                signal.signal(signum, signal.SIG_IGN)

    return asyncio.run(serve())
