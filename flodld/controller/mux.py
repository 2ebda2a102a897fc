"""The single controller port: accept, read the 4-byte magic under a deadline, route.

Each connection gets its own protocol object, so a silent or slow peer only ever holds its
own deadline timer, never the accept loop. Until the magic is in, bytes are buffered here;
then the transport is handed to the channel's handler (asyncio streams) or, for HTTP, to the
aiohttp protocol, with the buffered bytes replayed so nothing is lost. A plain `GET /state.json` is
answered here from the status source's bytes when the port has them
(`flodld.controller.status.fastget`); every other request still goes to aiohttp.

Until a stream connection's first frame verifies (the peer proved it holds the key), it keeps its
address's pre-admission gate slot (join: until admitted), and every byte it sends is counted
against a small per-connection allowance and one global pre-authentication budget
(`flodld.net.preauth`); the first frame itself is capped small by the frame layer. A peer without
the salt can hold at most that allowance per connection, and all of them together the budget.

HTTP is unauthenticated end to end, so the bytes an HTTP answer leaves queued in its transport (a reader
that reads slowly or not at all) count against one global budget too (`http_budget`, with a per-address
share of a quarter of it): an answer that would queue past either is cut at once and counted
(`http_budget`), not queued. Every HTTP connection, whichever path answers it, is aborted at
`http_lifetime`, even one already closing with bytes unsent. One HTTP connection's protocol and its
share of the budget are `flodld.controller.status.httpconn`; accepting in batches under uvloop is
`flodld.controller.accept`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import typing
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from flodld.controller.accept import AcceptDrain
from flodld.controller.addresses import CleartextWarner, is_loopback_address, is_private_address
from flodld.controller.status.fastget import Direct, HttpDate, answer_head, busy_answer
from flodld.controller.status.httpconn import (
    HTTP_WRITE_BUDGET_BYTES,
    HttpProtocolFactory,
    HttpQueued,
    LimitedLifetime,
)
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.status.snapshot import MemberRange, RenderRefused
from flodld.net.deadlines import Deadline, DeadlineQueue
from flodld.net.keepalive import Inherited, listen_with
from flodld.net.preauth import GatedReader, PreAuthBudget
from flodld.wire.magic import HTTP_PREFIXES, Channel, channel_for_prefix

log = logging.getLogger("flodld.controller.mux")

ChannelHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""A handler owns the connection after routing; the magic has been consumed. The mux closes
the writer when the handler returns or raises."""

StateBody = Callable[[MemberRange, str], bytes | None]
"""The status source's `state_body(members, source)`: state.json's bytes for a member page, None before there
is state; work past its cache is charged to the reader's address (`RenderRefused` past the budget)."""
ChannelProtocolFactory = Callable[["PortMux", str], asyncio.Protocol]
"""`factory(mux, peer)`: the protocol that serves a routed connection from its first byte after the magic.
It owns the peer's gate slot (releases it with `release_gate`), counts its pre-authentication bytes against
`mux.budget` (dropping with `mux.drop`) and reports its start and end with `mux.served`."""


@dataclass(frozen=True)
class _Route:
    handler: ChannelHandler | None
    hold_gate: bool
    protocol: ChannelProtocolFactory | None = None

MAGIC_DEADLINE_SECS = 5.0
# Our HTTP answers are small and our clients close after one request, so an HTTP connection gets a
# fixed lifetime: a slowloris head (aiohttp has no header deadline of its own) cannot pin an fd.
HTTP_CONNECTION_SECS = 5.0
MAX_PENDING_PER_PEER = 64
STREAM_LIMIT = 1 << 20


# Every connection's peer is judged twice (loopback for the gate, private for the cleartext warning); a
# storm comes from few addresses, so the answers are remembered (bounded: a flood of distinct sources
# only cycles the cache).
_is_loopback = functools.lru_cache(maxsize=4096)(is_loopback_address)
_is_private = functools.lru_cache(maxsize=4096)(is_private_address)


class PreAdmissionGate:
    """Caps connections per peer address that have not yet been routed (or, for joins, admitted).

    Loopback is exempt by default because every sshd forward arrives from 127.0.0.1: a cap
    there would throttle a legitimately tunneled fleet, and a local attacker owns the box anyway.
    """

    def __init__(self, limit: int = MAX_PENDING_PER_PEER, *, exempt_loopback: bool = True) -> None:
        self.limit = limit
        self.exempt_loopback = exempt_loopback
        self._pending: Counter[str] = Counter()

    def acquire(self, address: str) -> bool:
        if self.exempt_loopback and _is_loopback(address):
            return True
        if self._pending[address] >= self.limit:
            return False
        self._pending[address] += 1
        return True

    def release(self, address: str) -> None:
        if self._pending[address] > 0:
            self._pending[address] -= 1
            if self._pending[address] == 0:
                del self._pending[address]

    def pending(self, address: str) -> int:
        return self._pending[address]


class PortMux:
    """Owns the listening socket and the per-connection routing; knows nothing about runs."""

    def __init__(
        self,
        counters: ControllerCounters,
        *,
        magic_deadline: float = MAGIC_DEADLINE_SECS,
        http_lifetime: float = HTTP_CONNECTION_SECS,
        gate: PreAdmissionGate | None = None,
        warner: CleartextWarner | None = None,
        budget: PreAuthBudget | None = None,
        link_keepalive: float | None = None,
        http_budget: PreAuthBudget | None = None,
    ) -> None:
        """`link_keepalive`: the keepalive idle time (s) set on the listening socket, so every connection
        starts with it (see `Inherited`); a channel that wants another sets its own per connection.
        `http_budget`: the bytes HTTP answers may leave queued for their readers, all together
        (`HTTP_WRITE_BUDGET_BYTES` by default; see `HttpQueued`).
        """
        self.counters = counters
        self.link_keepalive = link_keepalive
        self.inherited = Inherited()
        """What accepted connections inherit from the listener (TCP_NODELAY, keepalive): set at `start()`."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop serving the port, from `start()` (protocols take it from here: under Python 3.11 each
        `asyncio.get_running_loop()` is a getpid() system call)."""
        self.magic_deadline = magic_deadline
        self.http_lifetime = http_lifetime
        self.gate = gate or PreAdmissionGate()
        self.budget = budget or PreAuthBudget()
        self.http_budget = http_budget or PreAuthBudget(HTTP_WRITE_BUDGET_BYTES)
        self._http_queued: Counter[str] = Counter()  # queued answer bytes per peer address
        self.warner = warner or CleartextWarner("controller")
        self._routes: dict[Channel, _Route] = {}  # the routing table: channel (from its magic) -> handler
        self._http_factory: HttpProtocolFactory | None = None
        self._state_body: StateBody | None = None
        self._http_date = HttpDate()
        self._server: asyncio.Server | None = None
        self._drains: list[AcceptDrain] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._served: set[asyncio.BaseTransport] = set()  # connections served by a channel protocol
        self._deadlines: dict[float, DeadlineQueue] = {}

    def register(self, channel: Channel, handler: ChannelHandler, *, hold_gate: bool = False) -> None:
        """Route `channel` to `handler`. The pre-admission slot stays taken until the connection's
        first frame verifies (or it ends); with `hold_gate`, until the handler calls
        `release_gate(peer)` instead (the join handshake does, once decided).
        """
        if channel is Channel.HTTP:
            raise ValueError("HTTP is served by set_http(), not a stream handler")
        self._routes[channel] = _Route(handler, hold_gate)

    def register_protocol(self, channel: Channel, factory: ChannelProtocolFactory) -> None:
        """Serve `channel` with an asyncio protocol per connection instead of a stream handler (no
        StreamReader, writer or task). The protocol holds the gate slot and does its own pre-authentication
        accounting (see `ChannelProtocolFactory`).
        """
        if channel is Channel.HTTP:
            raise ValueError("HTTP is served by set_http(), not a channel protocol")
        self._routes[channel] = _Route(None, True, factory)

    def unregister(self, channel: Channel) -> None:
        self._routes.pop(channel, None)

    def set_http(self, factory: HttpProtocolFactory | None, *, state_body: StateBody | None = None) -> None:
        """Serve HTTP with `factory` (aiohttp's server); with `state_body`, answer a plain `GET /state.json`
        with its bytes directly (see `flodld.controller.status.fastget`: a 200 only; anything else, aiohttp).
        """
        self._http_factory = factory
        self._state_body = state_body if factory is not None else None

    def release_gate(self, address: str) -> None:
        self.gate.release(address)

    def deadlines(self, timeout: float) -> DeadlineQueue:
        """The port's queue of `timeout`-s deadlines (one loop timer for all of a length: see
        `flodld.net.deadlines`); the mux's magic deadline is one, a run's handshake timeout another.
        """
        queue = self._deadlines.get(timeout)
        if queue is None:
            queue = self._deadlines[timeout] = DeadlineQueue(self.loop or asyncio.get_running_loop(), timeout)
        return queue

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and listen; returns the bound (host, port), the port resolved when 0 was asked.

        What start-up allocated (modules, classes, message schemas, the config) lives as long as the
        process: it is moved out of the cyclic collector's generations (`gc.freeze`), so the full
        collections a growing roster triggers scan only what serving allocated (at 5,000 joining hosts the
        collector took about a sixth of the controller's CPU; this saves a tenth of that).
        """
        gc.freeze()
        self.loop = loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _MuxProtocol(self), host, port, backlog=4096)
        except OSError as exc:
            raise OSError(exc.errno, f"controller: bind {host}:{port} failed: {exc.strerror}") from exc
        self.inherited = listen_with(list(self._server.sockets), self.link_keepalive)
        if type(loop).__module__.startswith("uvloop"):  # asyncio's own loop accepts in batches already
            for listening in self._server.sockets:
                with contextlib.suppress(OSError, ValueError):
                    self._drains.append(AcceptDrain(listening, loop, lambda: _MuxProtocol(self), self._tasks))
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    def bound_hosts(self) -> list[str]:
        """The address of every listening socket (a hostname may have bound several)."""
        return [str(sock.getsockname()[0]) for sock in (self._server.sockets if self._server else ())]

    def stop_listening(self) -> None:
        """Close the listening socket; routed connections keep running.

        No wait_closed(): since 3.12 it waits for every connection, and ours outlive the listener by
        design.
        """
        for drain in self._drains:
            drain.close()
        self._drains.clear()
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        """Stop accepting, then end every routed stream connection and wait for their handlers."""
        self.stop_listening()
        for writer in list(self._writers):
            writer.transport.abort()
        for transport in list(self._served):
            abort = getattr(transport, "abort", None)
            abort() if abort is not None else transport.close()
        for task in list(self._tasks):
            task.cancel()
        for queue in self._deadlines.values():
            queue.close()
        self._deadlines.clear()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # Called by _MuxProtocol -------------------------------------------------------------

    def _route(self, transport: asyncio.Transport, peer: str, buffered: bytes) -> None:
        prefix = buffered[:4]
        if prefix in HTTP_PREFIXES:
            self.gate.release(peer)
            if self._http_factory is None:
                self._drop(transport, peer, "no_handler", "no HTTP service running")
                return
            self.counters.connections[Channel.HTTP.value] += 1
            end = functools.partial(self._end_http, transport, peer)
            timer = self.deadlines(self.http_lifetime).call(end)
            direct = self._direct_state if self._state_body is not None and prefix == b"GET " else None
            loop = self.loop or asyncio.get_running_loop()
            self.counters.last_http_at = loop.time()
            queued = HttpQueued(self.http_budget, self._http_queued, transport, peer, self._drop, loop)
            proto = LimitedLifetime(self._http_factory, timer, direct, queued, peer)
            transport.set_protocol(proto)
            proto.connection_made(transport)
            proto.data_received(buffered)
            return
        channel = channel_for_prefix(prefix)
        if channel is None:
            self.gate.release(peer)
            magic = int.from_bytes(prefix, "little")
            self._drop(transport, peer, "unknown_magic", f"unknown channel magic 0x{magic:08x}")
            return
        route = self._routes.get(channel)
        if route is None:
            self.gate.release(peer)
            self._drop(transport, peer, "no_handler", f"no {channel.value}-channel service running")
            return
        self.counters.connections[channel.value] += 1
        if route.protocol is not None:
            served = route.protocol(self, peer)
            transport.set_protocol(served)
            served.connection_made(transport)
            if len(buffered) > 4 and not transport.is_closing():
                served.data_received(buffered[4:])
            return
        assert route.handler is not None
        loop = asyncio.get_running_loop()
        slot = _GateSlot(self.gate, peer, held_by_handler=route.hold_gate)
        reader = GatedReader(
            channel,
            self.budget,
            limit=STREAM_LIMIT,
            loop=loop,
            overrun=lambda code, detail: self._drop(transport, peer, code, detail),
            on_authenticated=slot.release,
        )
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        if len(buffered) > 4:
            protocol.data_received(buffered[4:])
        task = loop.create_task(self._run_handler(channel, route.handler, reader, writer, peer, slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_handler(
        self,
        channel: Channel,
        handler: ChannelHandler,
        reader: GatedReader,
        writer: asyncio.StreamWriter,
        peer: str,
        slot: _GateSlot,
    ) -> None:
        self._writers.add(writer)
        try:
            await handler(reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("event=handler_failed channel=%s peer=%s", channel.value, peer)
        finally:
            reader.settle()
            slot.release()
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _direct_state(self, direct: Direct, peer: str) -> tuple[bytes, bytes] | None:
        """The 200 answer to a direct state.json request (its head, then the shared body: written as they
        are, without a copy joining them), a 429 past the render budget, or None when aiohttp is to answer.
        """
        assert self._state_body is not None
        try:
            body = self._state_body(direct.members, peer)
        except RenderRefused as refused:  # refused cheaply, here: a flood of refusals never reaches aiohttp
            return busy_answer(direct, refused.retry_after, refused.detail, self._http_date()), b""
        except Exception:  # aiohttp's handler meets it again and answers (and logs) it as for any request
            return None
        if body is None:  # no state yet: the 503 is aiohttp's
            return None
        return answer_head(direct, len(body), self._http_date()), body

    def _end_http(self, transport: asyncio.Transport, peer: str) -> None:
        # The timer is cancelled when the connection is lost, so it is still there: open, or closing with
        # bytes its reader has not taken (a direct answer closes right after writing; a reader that never
        # reads would keep it, and its queued body, for as long as it liked).
        self._drop(
            transport, peer, "http_lifetime", f"HTTP connection open longer than {self.http_lifetime:g}s"
        )

    def served(self, transport: asyncio.BaseTransport, ended: bool) -> None:
        """A connection served by a channel protocol began (`ended` False) or ended."""
        if ended:
            self._served.discard(transport)
        else:
            self._served.add(transport)

    def drop(self, transport: asyncio.BaseTransport, peer: str, reason: str, detail: str) -> None:
        """Count, log and abort a connection (a channel protocol's pre-authentication overrun)."""
        self._drop(transport, peer, reason, detail)

    def _drop(self, transport: asyncio.BaseTransport, peer: str, reason: str, detail: str) -> None:
        self.counters.dropped[reason] += 1
        log.info("event=connection_dropped peer=%s reason=%s detail=%r", peer, reason, detail)
        abort = getattr(transport, "abort", None)
        abort() if abort is not None else transport.close()


class _GateSlot:
    """One routed connection's gate slot, released once: at its first verified frame or its end.

    Channels whose handler holds the gate (join) release it themselves through `release_gate`.
    """

    def __init__(self, gate: PreAdmissionGate, peer: str, *, held_by_handler: bool) -> None:
        self._gate = gate
        self._peer = peer
        self._released = held_by_handler

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._gate.release(self._peer)


class _MuxProtocol(asyncio.Protocol):
    """Buffers a fresh connection until its 4-byte magic is in, under the mux deadline."""

    def __init__(self, mux: PortMux) -> None:
        self._mux = mux
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._timer: Deadline | None = None
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport interface without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        self._peer = str(peername[0]) if peername else "?"
        if not _is_private(self._peer):  # the warner judges it again: public peers are the rare case
            self._mux.warner.check(self._peer)
        if not self._mux.gate.acquire(self._peer):
            self._done = True
            self._mux._drop(
                self._transport, self._peer, "flood", "too many pre-admission connections from this address"
            )
            return
        self._timer = self._mux.deadlines(self._mux.magic_deadline).call(self._deadline_passed)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        self._buffer += data
        if len(self._buffer) >= 4:
            self._finish()
            assert self._transport is not None
            self._mux._route(self._transport, self._peer, bytes(self._buffer))

    def eof_received(self) -> bool:
        if not self._done:
            self._finish()
            self._mux.gate.release(self._peer)
            reason = "truncated_magic" if self._buffer else "eof_before_magic"
            assert self._transport is not None
            self._mux._drop(self._transport, self._peer, reason, "closed before the channel magic")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done:
            self._finish()
            self._mux.gate.release(self._peer)
            self._mux.counters.dropped["reset_before_magic"] += 1

    def _deadline_passed(self) -> None:
        if self._done:
            return
        self._finish()
        self._mux.gate.release(self._peer)
        assert self._transport is not None
        self._mux._drop(
            self._transport, self._peer, "deadline", f"no channel magic within {self._mux.magic_deadline:g}s"
        )

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
