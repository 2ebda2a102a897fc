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
upstreams (`flodld.relay.upstream`), the fold of the deposits and where its chunks go
(`flodld.relay.deposits`, with the straggler clock's shell in `flodld.relay.stragglers`), what goes down
the legs (`flodld.relay.delivery`), the ranks' shared-memory regions (`flodld.relay.regions`) and the
entry of a walk-in's ranks, or of a healed slot's rank riding this relay (`flodld.relay.entry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from flodld.net.dispatch import serve_frames
from flodld.net.shm import ShmError
from flodld.net.stream import FramedStream
from flodld.relay.delivery import Delivery, send_quietly
from flodld.relay.deposits import DepositFold
from flodld.relay.entry import WalkInEntry
from flodld.relay.listener import RankListener, leg_end_level
from flodld.relay.regions import RankRegions
from flodld.relay.spec import RelayRoleSpec
from flodld.relay.upstream import dial_controller
from flodld.wire.control import CoordinatorHeartbeat, DeclareDead, Heartbeat, Shutdown
from flodld.wire.data import (
    Broadcast,
    DataPlaneError,
    Deposit,
    Entry,
    HelloAck,
    RankConnected,
    RankExpected,
    RankGone,
    RankHello,
    RankReady,
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

log = logging.getLogger("flodld.relay")

RIDER_HELLO_WAIT_SECS = 5.0
"""How long a rank leg's hello naming a rank this relay does not know waits for the controller's
RankExpected: a rider's hello and that word travel by different connections (docs/elastic-averaging.md,
"Slots heal in place")."""


@dataclass(frozen=True)
class _Leg:
    """Who a rank leg's frames come from (the context of the leg's dispatch table)."""

    rank: int
    stream: FramedStream


class Relay:
    def __init__(self, spec: RelayRoleSpec) -> None:
        self.spec = spec
        self.salt = bytes.fromhex(spec.salt_hex)
        self.host_key = bytes.fromhex(spec.host_key_hex)
        self.ranks = sorted(spec.ranks)
        self.legs: dict[Channel, dict[int, FramedStream]] = {Channel.DATA: {}, Channel.CONTROL: {}}
        self.gone: set[int] = set()
        self.upstream: dict[Channel, FramedStream] = {}
        self.finished = asyncio.Event()
        self.exit_code = 0
        self._warned_cleartext = False
        # The loopback listener for ranks: legs reach `_serve_leg` with a hello, pre-authenticated.
        self.listener = RankListener(len(self.ranks), self.salt, self._serve_leg)
        self._rank_data: HandlerTable[[_Leg, Frame], Awaitable[bool | None]] = HandlerTable("rank data frame")
        self._rank_data.register(Deposit, self._on_deposit)
        self._rank_data.register(ShmOffer, self._on_shm_offer)
        self._rank_data.register(ShmDeposit, self._on_shm_deposit)
        self._rank_data.register(RankReady, self._on_rank_ready)
        self.shm = RankRegions()
        self.down = Delivery(self.legs, self.shm, self._stopped_reading)
        # A walk-in (docs/elastic-averaging.md, "Growth and healing"): its entry round and state.
        self.entry = WalkInEntry(spec.walk_in, self.ranks, self.gone)
        self.down.first_round = self.entry.first_round  # a rider gets no result before its Entry's round
        self._roster = asyncio.Event()  # set (and replaced) when a rider is expected: its hello may wait
        self.deposits = DepositFold(
            self.ranks,
            self.gone,
            self.entry,
            self.down,
            straggler_timeout=spec.straggler_timeout,
            failed=lambda why: self._stop(why, 1),
        )
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
        self._from_controller.register(RankExpected, self._on_rank_expected)

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        """Dial both upstreams, serve the ranks, return the process exit code."""
        if self.entry.walk_in:  # it folds from the round it enters: load torch while its ranks start
            self.deposits.preload()
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
            self.down.rounds,
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
            self.deposits.upstream = stream
            self.deposits.sole_host = ack.sole_host
            if ack.sole_host:
                log.info("relay: host %r is the world's only host: rounds are broadcast here", self.spec.host)
            stream.read_directly()  # broadcasts go from the socket straight into their frame buffers
        return stream

    # --- ranks -----------------------------------------------------------------------------

    async def _serve_leg(self, channel: Channel, stream: FramedStream, hello: Message) -> None:
        """A pre-authenticated leg (`flodld.relay.listener`): its hello checked, then its frames served."""
        if isinstance(hello, RankHello) and hello.rank not in self.ranks and hello.rank not in self.gone:
            await self._expecting(hello.rank)
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

    async def _expecting(self, rank: int) -> None:
        """Until `rank` is one of this relay's (a rider the controller expects), or RIDER_HELLO_WAIT_SECS."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RIDER_HELLO_WAIT_SECS
        while rank not in self.ranks and (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._roster.wait(), left)

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

        def take() -> tuple[memoryview, Callable[[], None]]:
            # Folded into the accumulator, the frame's buffer is free again.
            return frame.tail_view, functools.partial(leg.stream.conn.recycle, frame)

        return await self.deposits.deposit(leg.rank, leg.stream, message, take)

    async def _on_shm_deposit(self, message: ShmDeposit, leg: _Leg, frame: Frame) -> bool:
        """Fold a chunk straight from the rank's region, as `_on_deposit` folds a framed one."""

        def lend() -> tuple[memoryview, Callable[[], None]]:
            region = self.shm.regions.get(leg.rank)
            if region is None:
                raise ShmError("a shared-memory deposit without an accepted region")
            data = region.data(message.offset, message.length)
            region.lend()
            return data, region.give_back

        return await self.deposits.deposit(leg.rank, leg.stream, message, lend)

    async def _on_shm_offer(self, message: ShmOffer, leg: _Leg, frame: Frame) -> None:
        """Map and check the rank's region (flodld.net.shm), or refuse it: the leg goes on framed."""
        if not self.shm.enabled:
            await leg.stream.send(ShmRefused(reason="shared memory is off on this relay (FLODL_SHM=off)"))
            return
        try:
            region = self.shm.map(message, leg.stream.writer)
        except ShmError as error:
            self.shm.refused += 1
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
            (await self.deposits.ready()).prepare(region.capacity)
        await leg.stream.send(ShmAccepted(size=message.size))

    async def _on_rank_ready(self, message: RankReady, leg: _Leg, frame: Frame) -> None:
        """A walk-in's rank waits to enter: the controller hears of it (RankConnected) once the relay can
        fold too, so the round the host enters waits neither for the rank's start-up nor for torch to load
        here. Only a walk-in's rank, once, before the Entry.
        """
        why = self.entry.ready(leg.rank)
        if why is not None:
            raise WireError("bad_payload", f"rank {leg.rank} sent RankReady {why}")
        await self.deposits.loaded()
        try:
            await self.upstream[Channel.DATA].send(RankConnected(rank=leg.rank))
        except (OSError, WireError) as error:
            self._stop(f"controller data channel failed: {error}", 1)
            raise

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
        self.entry.first_round.pop(rank, None)
        entered = rank not in self.entry.expected  # a rider that never entered was lost in no round
        try:
            in_round = await self.deposits.leave(rank) if entered else None
            if notify_upstream:
                gone = RankGone(rank=rank, reason=reason[:1024], round=in_round)
                await self.upstream[Channel.DATA].send(gone)
        except (OSError, WireError) as error:
            self._stop(f"controller data channel failed: {error}", 1)
            return
        if self.gone >= set(self.ranks):
            self._stop("every local rank has left", 0)

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
        if message.ranks:
            await self._riders_enter(message)
            return False
        why = self.entry.enter(message, self.deposits.barrier)
        if why is not None:
            self._stop(why, 1)
            return True
        log.info("relay: host %r enters the averaging at round %d", self.spec.host, message.round)
        if self.entry.complete:  # no state to wait for
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _on_rank_expected(self, message: RankExpected, stream: FramedStream, frame: Frame) -> None:
        """A healed slot's rank will ride this relay: its legs are served from now on."""
        why = self.entry.expect(message.rank)
        if why is not None:
            log.warning("relay: %s; ignored", why)
            return
        self.ranks = sorted([*self.ranks, message.rank])
        log.info("relay: rank %d of a healed slot rides host %r's relay", message.rank, self.spec.host)
        self._roster.set()
        self._roster = asyncio.Event()

    async def _riders_enter(self, message: Entry) -> None:
        """Riders enter at `message.round` (the state follows when `message.state`); a rider the fold cannot
        take there is refused and folded out, as a rank whose leg closed.
        """
        refused = self.entry.enter_riders(message, self.deposits.barrier)
        for rank, why in refused.items():
            log.warning("relay: refusing rank %d: %s", rank, why)
            leg = self.legs[Channel.DATA].get(rank)
            if leg is not None:
                await send_quietly(leg, DataPlaneError(reason=why))
            await self._rank_gone(rank, why, notify_upstream=True)
        entering = sorted(set(message.ranks) - set(refused) - self.gone)
        log.info("relay: rank(s) %s enter the averaging at round %d", entering, message.round)
        if not self.entry.taking_state:
            await self._hand_entry(dict(self.legs[Channel.DATA]))

    async def _take_state(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool:
        """A chunk of the walk-in's state (round `entry.round - 1`): kept, in order, until it is whole."""
        why = self.entry.take(message, frame.tail_view)
        if why is not None:
            self._stop(why, 1)
            return True
        stream.conn.recycle(frame)
        if not self.entry.taking_state:
            log.info("relay: host %r has the state of round %d (%d bytes)", self.spec.host, message.round,
                     self.entry.state_bytes)  # fmt: skip
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _hand_entry(self, legs: dict[int, FramedStream]) -> None:
        await self.entry.hand(legs, functools.partial(self._stopped_reading, channel=Channel.DATA))

    async def _on_broadcast(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool | None:
        if self.entry.taking_state:
            return await self._take_state(message, stream, frame)
        self.deposits.closed_above(message, frame.tail_view.nbytes)
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
