"""The relay: one per host, between the local ranks (loopback legs) and the controller (two upstreams).

Data: ranks deposit in chunks, the barrier folds each chunk of all live local deposits and sends it up
as a HostFrame chunk as soon as it is complete (pipelined, never a whole large frame stored first), and
the controller's Broadcast chunks are fanned out to the live ranks as they come. When the controller's
HelloAck says this is the world's only host (`sole_host`), the relay's fold is the world's: it finishes
each complete chunk itself and broadcasts it straight back to its ranks (no data frame goes to the
controller; RankGone still does, and liveness runs on CONTROL as always). Control: heartbeats up,
coordinator heartbeats / shutdown down, DeclareDead folds a rank out. A rank's leg closing folds it out
(RankGone up). The relay ends when every rank is gone, when the controller goes away, or on TERM.

The loopback listener for ranks serves only connections whose peer socket belongs to the relay's own
uid (`flodld.net.peeruid`, where /proc/net/tcp exists), holds at most `max_pending_rank_legs` legs
mid-handshake, counts what each sends before its RankHello verifies against the pre-auth allowance
and a budget of that many allowances (`flodld.net.preauth`), and drops a leg that has not proved the
salt by `RANK_PREAUTH_DEADLINE_SECS`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from flodld.fold import round_barrier
from flodld.fold.straggler import StragglerClock
from flodld.net.addresses import is_private_address
from flodld.net.dispatch import serve_frames
from flodld.net.inorder import InOrder
from flodld.net.keepalive import keep_alive
from flodld.net.peeruid import peer_uid_known_here, socket_owner_uid
from flodld.net.preauth import PREAUTH_CONNECTION_BYTES, GatedReader, PreAuthBudget
from flodld.net.shm import MappedRegion, ShmError, shm_mode
from flodld.net.stream import FramedStream, accept_channel, connect_with_retry, read_channel_prefix
from flodld.relay.spec import RelayRoleSpec
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
    RelayHello,
    ShmAccepted,
    ShmDeposit,
    ShmOffer,
    ShmRefused,
    ShmResult,
)
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame, Tail
from flodld.wire.handlers import HandlerTable
from flodld.wire.hostkey import relay_proof
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

log = logging.getLogger("flodld.relay")


def leg_end_level(error: BaseException) -> int:
    """How loud a rank leg's end is: DEBUG for the way a leaving rank's socket ends (EOF, or a reset or
    broken pipe when it exits with bytes unread), INFO for anything else. A rank's exit, clean or not,
    is reported by its agent; this line would only repeat it for every rank of every clean run.
    """
    leaving = isinstance(error, EOFError | ConnectionResetError | BrokenPipeError)
    return logging.DEBUG if leaving else logging.INFO


HANDSHAKE_TIMEOUT_SECS = 10.0
RANK_PREAUTH_DEADLINE_SECS = 10.0
"""From accept to a verified RankHello: a rank leg that has not proved the salt by then is dropped."""
RANK_LEG_STREAM_LIMIT = 1 << 16  # asyncio's default, as `start_server` used


def max_pending_rank_legs(ranks: int) -> int:
    """Rank legs allowed to be mid-handshake at once: both legs of every rank, plus slack for retries."""
    return 2 * ranks + 16


class _RankLegProtocol(asyncio.StreamReaderProtocol):
    """A rank leg's stream protocol that keeps its transport, so a pre-auth overrun can abort it."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream socket's transport
        super().connection_made(transport)


@dataclass(frozen=True)
class _Leg:
    """Who a rank leg's frames come from (the context of the leg's dispatch table)."""

    rank: int
    stream: FramedStream


def warn_if_public(peer: str, where: str) -> bool:
    """Log a warning when the controller's address is outside every private range; True if it did.

    The upstreams are encrypted (wire protocol v2), so the warning is about the salt they are keyed from:
    private only while the salt is (a configured join token; under open admission it crossed the path).
    """
    if is_private_address(peer):  # loopback included
        return False
    log.warning(
        "relay: WARNING: controller %s (peer %s) is outside every private address range. The relay's DATA "
        "and "
        "CONTROL upstreams to it are encrypted (AEAD, keys from the run salt and this host's admission), so "
        "they "
        "are private only while the salt is: with a configured join token; under open admission the salt "
        "crossed "
        "the path in the join's Accept, readable by whoever watched it. Process-group traffic (gloo/NCCL) is "
        "not "
        "flodld's and stays cleartext. Use a tunnel (`tunnel: true`, `fdl join --ssh`) or a VPN when in "
        "doubt",
        where,
        peer,
    )
    return True


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
        self._stragglers = StragglerClock(spec.straggler_timeout)
        self._straggler_timer: asyncio.TimerHandle | None = None
        self._straggler_tasks: set[asyncio.Task[None]] = set()
        self._late_logged = 0  # late chunks dropped, as last logged
        self.legs: dict[Channel, dict[int, FramedStream]] = {Channel.DATA: {}, Channel.CONTROL: {}}
        self.gone: set[int] = set()
        self.upstream: dict[Channel, FramedStream] = {}
        self.finished = asyncio.Event()
        self.exit_code = 0
        self.rounds = 0
        self.refused = 0
        self._warned_cleartext = False
        # The loopback listener for ranks (see _accept_rank): served only for this uid, at most
        # `max_pending_legs` legs mid-handshake holding at most the pre-auth budget, each dropped at
        # `preauth_deadline` unless its RankHello verified.
        self.rank_uid = os.getuid()
        self.preauth_deadline = RANK_PREAUTH_DEADLINE_SECS
        self.max_pending_legs = max_pending_rank_legs(len(self.ranks))
        self.preauth_budget = PreAuthBudget(self.max_pending_legs * PREAUTH_CONNECTION_BYTES)
        self.pending_legs = 0
        self.dropped: Counter[str] = Counter()
        self._rank_data: HandlerTable[[_Leg, Frame], Awaitable[bool | None]] = HandlerTable("rank data frame")
        self._rank_data.register(Deposit, self._on_deposit)
        self._rank_data.register(ShmOffer, self._on_shm_offer)
        self._rank_data.register(ShmDeposit, self._on_shm_deposit)
        # Shared memory (docs/protocol.md): each rank's checked region, and the round it last deposited
        # there (that round's result goes back through the region, every other round's framed).
        self.shm_enabled = shm_mode() != "off"
        self.regions: dict[int, MappedRegion] = {}
        self._shm_round: dict[int, int] = {}
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
        # A walk-in (docs/elastic-averaging.md, "Growth and healing"): its ranks enter at the round the
        # controller's Entry names, and get the state that follows it (the last averaged result) before
        # their first deposit. Kept here until every local rank has it (ranks connect at their own pace).
        self.walk_in = spec.walk_in
        self._entry: Entry | None = None
        self._entry_chunks: list[tuple[Broadcast, bytes]] = []
        self._entry_bytes = 0
        self._entry_complete = False
        self._handed: set[int] = set()

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        """Dial both upstreams, serve the ranks, return the process exit code."""
        for channel in (Channel.DATA, Channel.CONTROL):
            self.upstream[channel] = await self._dial(channel)
        listener = socket.socket(fileno=self.spec.listen_fd)
        server = await asyncio.get_running_loop().create_server(self._rank_leg_protocol, sock=listener)
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
        for region in self.regions.values():
            region.retire()
        self.regions.clear()
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
        stream = await connect_with_retry(
            self.spec.controller_host,
            self.spec.controller_port,
            channel,
            self.salt,
            what=f"relay {channel} upstream",
            attempts=self.spec.connect_attempts,
        )
        keep_alive(stream.writer)  # a vanished controller ends _read_upstream with an error
        peer = stream.writer.get_extra_info("peername")
        if peer and not self._warned_cleartext:
            self._warned_cleartext = warn_if_public(
                str(peer[0]), f"{self.spec.controller_host}:{self.spec.controller_port}"
            )
        listener_nonce = stream.conn.peer_nonce
        assert listener_nonce is not None  # the handshake completed
        proof = relay_proof(
            self.host_key,
            host=self.spec.host,
            channel=channel,
            dialer_nonce=stream.conn.nonce,
            listener_nonce=listener_nonce,
        )
        await stream.send(RelayHello(host=self.spec.host, ranks=self.ranks, proof=proof))
        reply = (await stream.recv(HANDSHAKE_TIMEOUT_SECS)).message()
        if not isinstance(reply, HelloAck):
            raise ConnectionError(f"controller refused the relay's {channel} channel: {reply!r}")
        stream.rekey(self.host_key)  # the controller rekeyed after its HelloAck: from here on, as this host
        if channel is Channel.DATA:
            self.sole_host = reply.sole_host
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
            if self._entry is not None:
                self._barrier.begin_at(self._entry.round)
        return self._barrier

    # --- ranks -----------------------------------------------------------------------------

    def _rank_leg_protocol(self) -> _RankLegProtocol:
        """A fresh loopback connection: its reader counts what it sends against the pre-auth bounds."""
        loop = asyncio.get_running_loop()
        protocol: _RankLegProtocol | None = None

        def overrun(code: str, detail: str) -> None:
            self._drop_leg(code, detail)
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()

        reader = GatedReader(
            Channel.DATA,  # a placeholder: accept_channel is told the leg's channel read from its magic
            self.preauth_budget,
            limit=RANK_LEG_STREAM_LIMIT,
            loop=loop,
            overrun=overrun,
        )
        protocol = _RankLegProtocol(reader, self._serve_rank, loop=loop)
        return protocol

    def _drop_leg(self, code: str, detail: str) -> None:
        """Count a loopback connection dropped before its hello; log the first of each kind (a flood of them
        must not become a flood of log lines).
        """
        self.dropped[code] += 1
        if self.dropped[code] == 1:
            log.warning("relay: dropped a loopback connection before its hello (%s): %s", code, detail)
        else:
            log.debug("relay: dropped a loopback connection before its hello (%s): %s", code, detail)

    def _peer_refusal(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        """Why this connection is not served before a byte of it is read, or None."""
        if self.pending_legs >= self.max_pending_legs:
            return "pending_cap", f"{self.max_pending_legs} loopback connections are mid-handshake already"
        if not peer_uid_known_here():
            return None  # no /proc/net/tcp: the loopback bind, the cap, the budget and the deadline bound it
        peer, ours = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        owner = socket_owner_uid((peer[0], peer[1]), (ours[0], ours[1])) if peer and ours else None
        if owner != self.rank_uid:
            whose = f"uid {owner}" if owner is not None else "an unknown owner"
            return "peer_uid", f"its socket belongs to {whose} (only the ranks' uid {self.rank_uid} may dial)"
        return None

    async def _serve_rank(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One rank leg's task. Cancelled when the relay stops (SIGTERM): that ends the leg quietly,
        since the streams callback that owns this task would log a cancelled handler as an error.
        """
        try:
            await self._serve_rank_leg(reader, writer)
        except asyncio.CancelledError:
            writer.close()
        finally:
            if isinstance(reader, GatedReader):
                reader.settle()  # whatever it still held goes back to the pre-auth budget

    async def _serve_rank_leg(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refused = self._peer_refusal(writer)
        if refused is not None:
            self._drop_leg(*refused)
            writer.transport.abort()  # nothing read, nothing sent
            return
        self.pending_legs += 1
        try:
            # One deadline for the whole pre-authentication: magic, key exchange and RankHello.
            async with asyncio.timeout(self.preauth_deadline):
                channel, _ = await read_channel_prefix(reader, timeout=self.preauth_deadline)
                if channel not in self.legs:
                    self._drop_leg("unknown_magic", "not a DATA or CONTROL leg")
                    writer.close()
                    return
                assert channel is not None
                stream = await accept_channel(
                    reader, writer, self.salt, channel=channel, timeout=self.preauth_deadline
                )
                hello = (await stream.recv(self.preauth_deadline)).message()
        except (TimeoutError, EOFError, OSError, WireError, asyncio.IncompleteReadError) as error:
            if not (isinstance(reader, GatedReader) and reader.refused):  # an overrun was counted already
                self._drop_leg(type(error).__name__, str(error) or "no hello before the deadline")
            writer.transport.abort()
            return
        finally:
            self.pending_legs -= 1
        refusal = (
            self._check_rank_hello(channel, hello)
            if isinstance(hello, RankHello)
            else f"expected RankHello on a {channel} leg, got {type(hello).__name__}"
        )
        if refusal is not None or not isinstance(hello, RankHello):
            log.warning("relay: %s", refusal)
            await self._send_quietly(stream, DataPlaneError(reason=refusal or "no RankHello"))
            stream.close()
            return
        rank = hello.rank
        self.legs[channel][rank] = stream
        try:
            await stream.send(HelloAck())
            if channel is Channel.DATA and self.walk_in and self._entry is None:
                # The controller lets a walk-in in once every rank of it is here to take the state.
                try:
                    await self.upstream[Channel.DATA].send(RankConnected(rank=rank))
                except (OSError, WireError) as error:
                    self._stop(f"controller data channel failed: {error}", 1)
                    raise
            if channel is Channel.DATA and self._entry_complete and rank not in self._handed:
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
        barrier = self._ensure_barrier()
        conn = leg.stream.conn
        if self._failed_round is not None:
            await self._send_quietly(leg.stream, DataPlaneError(reason=self._failed_round))
            return True
        try:
            # Folded into the accumulator, the frame's buffer is free again.
            release = functools.partial(conn.recycle, frame)
            before = barrier.round
            results = barrier.contribute_message(leg.rank, message, frame.tail_view, release)
        except Exception as error:
            return await self._refuse_deposit(leg, error)
        self._watch_stragglers(barrier, before, leg.rank)
        await self._outbox.send(results, self._ship)
        return False

    async def _refuse_deposit(self, leg: _Leg, error: Exception) -> bool:
        """Any decode or fold failure of a deposit (framed or shared) refuses this rank, never kills the
        relay. True: the leg stops.
        """
        self.refused += 1
        log.error("relay: refusing rank %d: %s: %s", leg.rank, type(error).__name__, error)
        await self._send_quietly(leg.stream, DataPlaneError(reason=str(error)[:1024]))
        return True

    async def _on_shm_offer(self, message: ShmOffer, leg: _Leg, frame: Frame) -> None:
        """Map and check the rank's region (flodld.net.shm), or refuse it: the leg goes on framed."""
        if not self.shm_enabled:
            await leg.stream.send(ShmRefused(reason="shared memory is off on this relay (FLODL_SHM=off)"))
            return
        writer = leg.stream.writer
        peer, mine = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        try:
            if not peer or not mine or len(peer) != 2:
                raise ShmError("the data leg is not an IPv4 loopback connection")
            region = MappedRegion(
                message.pid,
                message.fd,
                message.size,
                bytes.fromhex(message.tag),
                leg=((str(peer[0]), int(peer[1])), (str(mine[0]), int(mine[1]))),
            )
        except ShmError as error:
            self.refused += 1
            log.warning("relay: refused rank %d's shared memory offer: %s", leg.rank, error)
            await leg.stream.send(ShmRefused(reason=str(error)[:1024]))
            return
        old = self.regions.pop(leg.rank, None)
        if old is not None:
            old.retire()
        if leg.rank in self.gone:  # pragma: no cover - a gone rank's leg is closed before its next frame
            region.retire()
            return
        self.regions[leg.rank] = region
        # The region's size is the rounds' to come: fault in their accumulator now, not chunk by chunk.
        if region.populated:  # the rank made its pages: its rounds are that big
            self._ensure_barrier().prepare(region.capacity)
        await leg.stream.send(ShmAccepted(size=message.size))

    async def _on_shm_deposit(self, message: ShmDeposit, leg: _Leg, frame: Frame) -> bool:
        """Fold a chunk straight from the rank's region, as `_on_deposit` folds a framed one."""
        barrier = self._ensure_barrier()
        if self._failed_round is not None:
            await self._send_quietly(leg.stream, DataPlaneError(reason=self._failed_round))
            return True
        region = self.regions.get(leg.rank)
        lent = False
        try:
            if region is None:
                raise ShmError("a shared-memory deposit without an accepted region")
            data = region.data(message.offset, message.length)
            region.lend()
            lent = True
            before = barrier.round
            results = barrier.contribute_message(leg.rank, message, data, region.give_back)
        except Exception as error:
            if lent and region is not None:
                region.give_back()
            return await self._refuse_deposit(leg, error)
        if message.round >= before:  # a late chunk's round was delivered framed already
            self._shm_round[leg.rank] = message.round
        self._watch_stragglers(barrier, before, leg.rank)
        await self._outbox.send(results, self._ship)
        return False

    # --- stragglers (flodld.fold.straggler) ---------------------------------------------------

    def _watch_stragglers(self, barrier: RoundBarrier[int], before: int, rank: int) -> None:
        """After `rank`'s chunk was taken: the round still open at `before` starts its straggler clock."""
        if barrier.late_chunks != self._late_logged:
            self._late_logged = barrier.late_chunks
            log.info(
                "relay: dropped rank %d's late deposit chunk (its round closed without it; %d so far)",
                rank,
                barrier.late_chunks,
            )
        if self._stragglers.timeout is None or barrier.round != before or not barrier.started:
            return
        loop = asyncio.get_running_loop()
        if self._stragglers.wake_at(before) is None:
            self._stragglers.opened(before, loop.time())
            wake = self._stragglers.wake_at(before)
            assert wake is not None
            if self._straggler_timer is not None:
                self._straggler_timer.cancel()
            self._straggler_timer = loop.call_at(wake, self._stragglers_due, before)

    def _stragglers_due(self, round_number: int) -> None:
        """The timer: skip the ranks that still owe `round_number`, if it is still open."""
        self._straggler_timer = None
        barrier = self._barrier
        loop = asyncio.get_running_loop()
        if (
            barrier is None
            or barrier.round != round_number
            or not self._stragglers.due(round_number, loop.time())
        ):
            return
        late = sorted(barrier.waiting_for)
        log.warning(
            "relay: round %d closes without rank(s) %s: no deposit %gs after its first (straggler_timeout)",
            round_number,
            late,
            self._stragglers.timeout,
        )
        sending = self._outbox.send(barrier.skip(late), self._ship)

        async def ship() -> None:
            try:
                await sending
            except (OSError, WireError) as error:
                self._stop(f"controller data channel failed: {error}", 1)

        task = loop.create_task(ship())
        self._straggler_tasks.add(task)
        task.add_done_callback(self._straggler_tasks.discard)

    def _closed_above(self, message: Broadcast, nbytes: int) -> None:
        """The controller finished `message.round` (its last chunk is here): a round this relay still
        folds is over without the local ranks still owing it (the controller skipped this host). Their
        partial fold is dropped, and the ranks' next deposits find the next round open.
        """
        barrier = self._barrier
        if self._stragglers.timeout is None or barrier is None or barrier.round > message.round:
            return
        if message.offset + nbytes != sum(spec.nbytes() for spec in message.tensors):
            return
        while barrier.round <= message.round:
            late = sorted(barrier.waiting_for)
            log.warning(
                "relay: round %d closed at the controller without rank(s) %s (straggler_timeout)",
                barrier.round,
                late,
            )
            open_round = barrier.round
            barrier.skip(late)  # chunks it completes are not shipped: the controller has the round
            if barrier.round == open_round:  # pragma: no cover - skip closes a round nobody owes
                break

    async def _unexpected_on_data_leg(self, message: Message, leg: _Leg) -> bool:
        raise WireError("bad_payload", f"rank {leg.rank} sent {type(message).__name__} on its data leg")

    async def _on_heartbeat(self, message: Heartbeat, leg: _Leg, frame: Frame) -> None:
        if message.rank == leg.rank:
            await self.upstream[Channel.CONTROL].send(message)

    async def _rank_gone(self, rank: int, reason: str, *, notify_upstream: bool) -> None:
        if rank in self.gone:
            return
        self.gone.add(rank)
        for legs in self.legs.values():
            leg = legs.pop(rank, None)
            if leg is not None:
                leg.close()
        region = self.regions.pop(rank, None)
        self._shm_round.pop(rank, None)
        if region is not None:
            region.retire()  # unmapped now, or once the fold gave back the chunks it still holds
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
        frame = HostFrame(
            round=result.round,
            fold=result.fold_spec,
            weight=result.weight,
            contributors=sorted(result.contributors),
            tensors=list(result.specs),
            offset=result.offset,
        )
        await self.upstream[Channel.DATA].send(frame, result.byte_views())

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
            failure = DataPlaneError(reason=self._failed_round)
            legs = list(self.legs[Channel.DATA].values())
            await asyncio.gather(*(self._send_quietly(leg, failure) for leg in legs))
            return
        if result.offset == 0:
            self.rounds += 1
        message = Broadcast(
            round=result.round,
            fold=result.fold_spec,
            weight=result.weight,
            contributors=sorted(result.contributors),
            tensors=list(result.specs),
            offset=result.offset,
        )
        await self._deliver(message, result.byte_views())

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
        if not self.walk_in or self._entry is not None:
            why = "an Entry to a relay that did not walk in" if not self.walk_in else "a second Entry"
            self._stop(f"controller sent {why}", 1)
            return True
        self._entry = message
        if self._barrier is not None:
            try:
                self._barrier.begin_at(message.round)
            except ValueError as error:  # a rank deposited before its entry: the relay is out of step
                self._stop(f"cannot enter at round {message.round}: {error}", 1)
                return True
        log.info("relay: host %r enters the averaging at round %d", self.spec.host, message.round)
        if not message.state:
            self._entry_complete = True
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _take_state(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool:
        """A chunk of the walk-in's state (round `entry.round - 1`): kept, in order, until it is whole."""
        entry = self._entry
        view = frame.tail_view
        total = sum(spec.nbytes() for spec in message.tensors)
        if (
            entry is None
            or message.round != entry.round - 1
            or message.offset != self._entry_bytes
            or message.offset + view.nbytes > total
        ):
            self._stop(f"controller sent a state chunk out of turn (round {message.round}, "
                       f"offset {message.offset})", 1)  # fmt: skip
            return True
        self._entry_chunks.append((message, bytes(view)))
        self._entry_bytes += view.nbytes
        stream.conn.recycle(frame)
        if self._entry_bytes == total:
            self._entry_complete = True
            log.info("relay: host %r has the state of round %d (%d bytes)", self.spec.host, message.round,
                     total)  # fmt: skip
            await self._hand_entry(dict(self.legs[Channel.DATA]))
        return False

    async def _hand_entry(self, legs: dict[int, FramedStream]) -> None:
        """Entry and the state to each of `legs` not handed them yet; the kept copy goes once every local
        rank has it (or is gone).
        """
        entry = self._entry
        if entry is None:
            return
        todo = {rank: leg for rank, leg in legs.items() if rank not in self._handed}
        self._handed.update(todo)

        async def one(rank: int, leg: FramedStream) -> None:
            try:
                await leg.send(entry)
                for chunk, data in self._entry_chunks:
                    await leg.send(chunk, data)
            except (OSError, WireError):
                await self._rank_gone(rank, f"rank {rank} stopped reading its data leg", notify_upstream=True)

        chunks = self._entry_chunks
        await asyncio.gather(*(one(rank, leg) for rank, leg in todo.items()))
        if self._handed | self.gone >= set(self.ranks) and self._entry_chunks is chunks:
            self._entry_chunks = []  # every rank has it: the copy is not needed any more

    async def _on_broadcast(self, message: Broadcast, stream: FramedStream, frame: Frame) -> bool | None:
        if self.walk_in and not self._entry_complete:
            return await self._take_state(message, stream, frame)
        if message.offset == 0:
            self.rounds += 1
        self._closed_above(message, frame.tail_view.nbytes)
        await self._deliver(message, [frame.tail_view])
        stream.conn.recycle(frame)  # sealed into every leg's frame: its buffer is free
        return None

    async def _on_coordinator_word(
        self, message: CoordinatorHeartbeat | Shutdown, stream: FramedStream, frame: Frame
    ) -> None:
        await self._fan_out(Channel.CONTROL, message, b"")

    async def _on_declare_dead(self, message: DeclareDead, stream: FramedStream, frame: Frame) -> None:
        log.warning("relay: controller declared rank %d dead: %s", message.rank, message.reason)
        await self._rank_gone(message.rank, message.reason, notify_upstream=False)

    async def _on_refused(self, message: DataPlaneError, stream: FramedStream, frame: Frame) -> bool:
        self._stop(f"controller refused this host's data: {message.reason}", 1)
        return True

    async def _fan_out(self, channel: Channel, message: Message, tail: Tail) -> None:
        await self._fan_out_to(channel, dict(self.legs[channel]), message, tail)

    async def _fan_out_to(
        self, channel: Channel, legs: dict[int, FramedStream], message: Message, tail: Tail
    ) -> None:
        async def one(rank: int, leg: FramedStream) -> None:
            try:
                await leg.send(message, tail)
            except (OSError, WireError):
                await self._rank_gone(
                    rank, f"rank {rank} stopped reading its {channel} leg", notify_upstream=True
                )

        # Concurrently: the next leg's frame is sealed while the previous one drains into its rank.
        await asyncio.gather(*(one(rank, leg) for rank, leg in legs.items()))

    async def _deliver(self, message: Broadcast, parts: list[memoryview]) -> None:
        """A result chunk to every live rank: written into the region of each rank that deposited this
        round there (over its own, already folded, bytes of this chunk) with a small `ShmResult`; framed
        to the others.
        """
        length = sum(part.nbytes for part in parts)
        notice: ShmResult | None = None
        framed: dict[int, FramedStream] = {}
        shared: dict[int, FramedStream] = {}
        for rank, leg in list(self.legs[Channel.DATA].items()):
            region = self.regions.get(rank)
            if (
                region is None
                or self._shm_round.get(rank) != message.round
                or message.offset + length > region.capacity
            ):
                framed[rank] = leg
                continue
            region.write(message.offset, parts)
            shared[rank] = leg
        if shared:
            notice = ShmResult(
                round=message.round,
                fold=message.fold,
                weight=message.weight,
                contributors=message.contributors,
                tensors=message.tensors,
                offset=message.offset,
                length=length,
            )
        await asyncio.gather(
            self._fan_out_to(Channel.DATA, framed, message, parts),
            *([self._fan_out_to(Channel.DATA, shared, notice, b"")] if notice is not None else []),
        )

    @staticmethod
    async def _send_quietly(stream: FramedStream, message: Message) -> None:
        try:
            await stream.send(message)
        except (OSError, WireError):
            pass


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
