"""The join channel: handshake a dialer, hand its Hello to the run, then supervise the link.

Per connection: nonce exchange and the first frame under the handshake deadline. Frame-level
failures (wrong salt, garbage, silence) get no reply, only a log line and a counted refusal;
a well-formed but unacceptable hello gets a Reject. Once admitted, the same connection carries
WorldFormed/Abort down and RankExited up, and its EOF is the host's exit event.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import typing
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from flodld.controller.metrics import ControllerCounters
from flodld.net.deadlines import Deadline, DeadlineQueue
from flodld.net.keepalive import Inherited, keep_alive, tcp_socket
from flodld.net.preauth import PreAuthBudget
from flodld.net.preauth import charge as preauth_charge
from flodld.net.stream import WRITE_STALL_SECS
from flodld.net.timeouts import scaled
from flodld.wire.errors import WireError
from flodld.wire.frames import Closed, Frame, FrameConnection, NeedData, Role
from flodld.wire.handlers import HandlerTable
from flodld.wire.join import Accept, Hello, RankExited, Reject
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

log = logging.getLogger("flodld.controller.join")

CHANNEL = "join"
MAX_JOIN_PAYLOAD = 1024 * 1024
# Join handshakes that may run their CPU-bound steps (key derivation and the dialer's nonce; the hello's
# decoding and admission) in one event-loop turn. A storm of thousands of dialers otherwise makes every
# turn run one step of each of them, and an HTTP request (several turns from accept to answer) waits
# behind each such turn: a poll took seconds. Waiting here holds nothing (a place in line for a later
# turn, not a slot kept while the peer is slow), so a silent or slow peer cannot hold up the others.
# The knob trades storm throughput for the other requests' latency. 24 since state.json is answered without
# aiohttp and deadlines share a timer (10,000-agent storms, 2026-12-03, alternating runs: admissions/s
# 0.61-0.73 of the baseline at 16, 0.65-0.78 at 24, 0.68-0.75 at 32; state.json p99 27-33 ms at 16, 28-44 ms
# at 24, 30-90 ms at 32). Before that: 16 (p99 43-48 ms at 16, 63-95 ms at 32, 38-39 ms at 8).
JOIN_STEPS_PER_TURN = 24


class TurnBudget:
    """At most `per_turn` steps given to `call()` run per event-loop turn; the others wait, in order, for
    later turns. Sans-io apart from the loop's `call_soon`.
    """

    def __init__(self, per_turn: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if per_turn < 1:
            raise ValueError(f"a turn budget lets >= 1 step through, got {per_turn}")
        self.per_turn = per_turn
        self._loop = loop  # None: the running loop, asked when a turn is scheduled
        self._used = 0
        self._waiters: deque[Callable[[], None]] = deque()
        self._refill_scheduled = False
        self.deferred = 0
        """How many steps waited for a later turn (for tests and diagnostics)."""

    def call(self, step: Callable[[], None]) -> None:
        """Run `step` now if this turn's budget allows (and nobody waits), else in a later turn, in order.

        A step that raises is logged; the turn goes on. A step whose connection ended meanwhile still takes
        its place in line (it returns at once: the join protocol's steps check their state first).
        """
        if self._used < self.per_turn and not self._waiters:
            self._used += 1
            self._schedule_refill()
            step()
            return
        self._waiters.append(step)
        self.deferred += 1
        self._schedule_refill()

    def _schedule_refill(self) -> None:
        if not self._refill_scheduled:
            self._refill_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._refill)

    def _refill(self) -> None:
        """Runs once per turn while anything is counted or waiting: a new turn's budget, first to waiters."""
        self._refill_scheduled = False
        self._used = 0
        while self._waiters and self._used < self.per_turn:
            step = self._waiters.popleft()
            self._used += 1
            try:
                step()
            except Exception:
                log.exception("event=join_step_failed")
        if self._used or self._waiters:
            self._schedule_refill()


_BUDGETS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnBudget] = weakref.WeakKeyDictionary()
# The last loop asked about and its budget: a controller has one loop, and a WeakKeyDictionary lookup
# (a new weak reference per call) cost ~30 us per join under a storm.
_LAST: tuple[weakref.ref[asyncio.AbstractEventLoop], TurnBudget] | None = None


# Thousands of linked hosts are thousands of long-lived objects (stream, connection, task, buffers per
# link); the collector's full collections rescan all of them each time the heap grows by a quarter: at
# 10,000 joining hosts eight full collections took ~3.9 s of the controller's time, the longest 1.6 s
# (a stall every poller and joiner waited behind). Every FREEZE_EVERY admissions, what the process holds is
# moved out of the collector's generations (`gc.freeze`, O(1)); when the last link of the process closes,
# it is all handed back (`gc.unfreeze`) and the next full collection reclaims whatever cycles the run left.
# A process that never links that many hosts at once never freezes anything here.
FREEZE_EVERY = 1024
# What the full collections of a storm still scan is mostly the dials in flight (~40 tracked objects each:
# ~100,000 objects with 2,500 connections in their handshake, 30-70 ms of CPU per collection, collecting
# nothing). While STORM_LINKS hosts or more are linked, the oldest generation is collected
# FULL_COLLECTION_SPACING times less often (its threshold multiplied); restored when the last link ends.
STORM_LINKS = 256
FULL_COLLECTION_SPACING = 10


class _LinkedHeap:
    linked = 0
    admitted_since_freeze = 0
    froze = False
    thresholds: tuple[int, ...] | None = None
    """The collector's thresholds before a storm spaced its full collections; None outside one."""


def _link_opened() -> None:
    _LinkedHeap.linked += 1
    _LinkedHeap.admitted_since_freeze += 1
    if _LinkedHeap.linked >= STORM_LINKS and _LinkedHeap.thresholds is None:
        _LinkedHeap.thresholds = thresholds = gc.get_threshold()
        if len(thresholds) == 3:
            gc.set_threshold(thresholds[0], thresholds[1], thresholds[2] * FULL_COLLECTION_SPACING)
    if _LinkedHeap.admitted_since_freeze >= FREEZE_EVERY:
        _LinkedHeap.admitted_since_freeze = 0
        _LinkedHeap.froze = True
        gc.freeze()


def _link_ended() -> None:
    _LinkedHeap.linked -= 1
    if _LinkedHeap.linked <= 0:
        _LinkedHeap.linked = 0
        _LinkedHeap.admitted_since_freeze = 0
        if _LinkedHeap.thresholds is not None:
            gc.set_threshold(*_LinkedHeap.thresholds)
            _LinkedHeap.thresholds = None
        if _LinkedHeap.froze:
            _LinkedHeap.froze = False
            gc.unfreeze()


def join_turns(loop: asyncio.AbstractEventLoop | None = None) -> TurnBudget:
    """`loop`'s join-step budget (one per loop: every run on a controller port shares it); by default the
    running loop's (under Python 3.11 asking for it is a getpid() system call: callers that know it pass it).
    """
    global _LAST
    if loop is None:
        loop = asyncio.get_running_loop()
    last = _LAST
    if last is not None and last[0]() is loop:
        return last[1]
    budget = _BUDGETS.get(loop)
    if budget is None:
        budget = _BUDGETS[loop] = TurnBudget(JOIN_STEPS_PER_TURN, loop)
    _LAST = (weakref.ref(loop), budget)
    return budget


class LinkStream(Protocol):
    """What the run uses of an admitted host's join connection (a `JoinProtocol`)."""

    @property
    def conn(self) -> FrameConnection:
        """The connection's frame state (its nonces key the host key)."""

    def send_nowait(self, msg: Message) -> None:
        """Queue one message frame."""

    async def drain(self) -> None:
        """Wait until what was queued is handed to the socket (bounded)."""

    def rekey(self, salt: bytes) -> None:
        """Both directions to the keys of `salt` (open admission, after the Accept)."""

    def close(self) -> None:
        """Close the connection."""

    def write_buffered(self) -> bool:
        """Whether bytes written still wait in the transport (unknown: assume so)."""


@dataclass
class HostLink:
    """An admitted host's join connection."""

    host: str
    stream: LinkStream
    peer: str
    local_address: str
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    host_key: bytes = b""
    """Derived at admission (`flodld.wire.hostkey`): what the host's relay must prove on DATA/CONTROL."""


class JoinRun(Protocol):
    """What the join channel asks of the run it admits hosts to (the Controller is one).

    The channel handshakes and reads frames; every decision (refuse, admit, what an exit or a link's end
    means) belongs to the run.
    """

    @property
    def counters(self) -> ControllerCounters:
        """Frame counts per channel."""

    @property
    def join_key(self) -> bytes:
        """The key of pre-admission join frames."""

    @property
    def advertised_host(self) -> str:
        """The controller's address when the socket cannot tell which local address a dialer reached."""

    @property
    def handshake_timeout(self) -> float:
        """Seconds a dialer has for the nonce exchange and its hello."""

    @property
    def link_keepalive_secs(self) -> float:
        """TCP keepalive idle time of an admitted link (already scaled)."""

    def release_gate(self, peer: str) -> None:
        """The peer's pre-admission slot is free again (admitted, refused or gone)."""

    def refuse(self, peer: str, code: str, reason: str) -> None:
        """Count and log a join attempt refused before the window decided it."""

    def admit(self, hello: Hello, link: HostLink) -> Accept | Reject:
        """Decide a hello; on admission the Accept is already queued on `link` (and its host key set)."""

    def rank_exited(self, link: HostLink, rank: int, code: int, report: RankExited | None = None) -> None:
        """The host reported a rank's exit code (`report`: the whole message, for the root cause)."""

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None:
        """The link ended.

        Cleanly (`lost=False`: the host closed it) or not (reset, bad frame, failed write).
        """


REPORTS: HandlerTable[[JoinRun, HostLink], None] = HandlerTable("join-link report")
"""What an admitted host may send up its join link; any other kind is logged and ignored."""


@REPORTS.handles(RankExited)
def _rank_exited(message: RankExited, controller: JoinRun, link: HostLink) -> None:
    controller.rank_exited(link, message.rank, message.code, message)


class JoinPort(Protocol):
    """What a `JoinProtocol` asks of the port that routed it to the join channel (the `PortMux`)."""

    @property
    def budget(self) -> PreAuthBudget:
        """The global pre-authentication budget."""

    @property
    def inherited(self) -> Inherited:
        """The TCP options every connection of the port starts with (set once on its listening socket)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop serving the port (None: the running one)."""

    def deadlines(self, timeout: float) -> DeadlineQueue:
        """The port's queue of `timeout`-s deadlines."""

    def drop(self, transport: asyncio.BaseTransport, peer: str, reason: str, detail: str) -> None:
        """Count, log and abort a connection the port refuses (pre-authentication overrun)."""

    def served(self, transport: asyncio.BaseTransport, ended: bool) -> None:
        """A connection this protocol serves began or ended (the port aborts the live ones at close)."""


# Where a join connection stands (`JoinProtocol._state`).
_STARTING = 0  # routed, waiting for its turn to write its nonce
_HANDSHAKE = 1  # nonce written; reading the dialer's nonce and its first frame under the deadline
_DECIDING = 2  # first frame verified; waiting for its turn to be decoded and decided (reading paused)
_LINKED = 3  # admitted: WorldFormed/Abort down, RankExited up, until either side closes
_ENDED = 4


class JoinProtocol(asyncio.Protocol):
    """One join connection served without a stream, task or coroutine: bytes go straight into the sans-io
    `FrameConnection` and each verified frame into the run (`JoinRun`).

    The rules (and refusals) of a stream channel behind a `GatedReader` and `accept_channel`:
    - the magic's deadline is the mux's; from routing, the nonce exchange and the first frame are due
      within the run's `handshake_timeout` (`handshake_timeout` refusal, no reply);
    - until the first frame verifies, every byte counts against the per-connection allowance
      (`PREAUTH_CONNECTION_BYTES`) and the port's global budget (`preauth_overrun` / `preauth_budget`,
      dropped by the port); the first frame is capped small by the frame layer;
    - the address's pre-admission gate slot is held until the hello is decided (or the connection ends);
    - every frame is verified (AEAD, sequence: `bad_tag`, `replay`, ... refusals, no reply); nothing is
      allocated for the host before its hello verified and was admitted;
    - a hello that does not decode, or another first message, gets a Reject with the reason; the run's
      own Reject is sent as it is.
    The CPU-bound steps (this side's nonce and keys; the hello's decoding and admission) go through the
    loop's `TurnBudget`. Once admitted, the protocol object is the link's stream
    (`LinkStream`): it writes WorldFormed/Abort, hands RankExited to the run, and reports the link's end.
    """

    __slots__ = (
        "_conn",
        "_drained",
        "_early",
        "_eof",
        "_gate_held",
        "_held",
        "_link",
        "_loop",
        "_paused",
        "_peer",
        "_port",
        "_run",
        "_state",
        "_timer",
        "_transport",
        "local_address",
    )

    def __init__(self, run: JoinRun, port: JoinPort, peer: str) -> None:
        self._run = run
        self._port = port
        self._peer = peer
        self._transport: asyncio.Transport | None = None
        self._state = _STARTING
        self._conn: FrameConnection | None = None
        self._early = b""  # bytes that came before this side's turn to start
        self._eof = False
        self._held = 0  # pre-authentication bytes counted against the budget (0 once settled)
        self._timer: Deadline | None = None
        self._gate_held = True
        self._link: HostLink | None = None
        self._paused = False  # the transport's write buffer is over its high-water mark
        self._drained: asyncio.Future[None] | None = None
        self._loop = port.loop or asyncio.get_running_loop()
        self.local_address = run.advertised_host

    # --- LinkStream ------------------------------------------------------------------------------

    @property
    def conn(self) -> FrameConnection:
        assert self._conn is not None
        return self._conn

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    def send_nowait(self, msg: Message) -> None:
        assert self._conn is not None and self._transport is not None
        self._transport.write(self._conn.send_message(msg))

    async def drain(self) -> None:
        if self._transport is None or self._state == _ENDED:
            raise ConnectionResetError("the join link is closed")
        if not self._paused:
            return
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()
        async with asyncio.timeout(scaled(WRITE_STALL_SECS)):
            await asyncio.shield(self._drained)

    def rekey(self, salt: bytes) -> None:
        self.conn.rekey(salt)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def write_buffered(self) -> bool:
        """Whether bytes written still wait in the transport."""
        transport = self._transport
        return transport is None or transport.is_closing() or transport.get_write_buffer_size() > 0

    # --- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's do not subclass Transport
        self._port.served(transport, False)
        sockname = transport.get_extra_info("sockname")
        if sockname:
            self.local_address = str(sockname[0])
        self._timer = self._port.deadlines(self._run.handshake_timeout).call(self._deadline_passed)
        join_turns(self._loop).call(self._start)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state == _LINKED:
            assert self._conn is not None
            self._conn.receive_data(data)
            self._pump_link()
            return
        if state == _ENDED:
            return
        if self._held >= 0 and data:  # pre-authentication: count before holding anything
            refusal = preauth_charge(self._port.budget, self._held, len(data))
            if refusal is not None:
                self._overrun(*refusal)
                return
            self._held += len(data)
        if self._conn is None:
            self._early += data
            return
        self._conn.receive_data(data)
        if state == _HANDSHAKE:
            self._pump_handshake()

    def eof_received(self) -> bool:
        if self._state in (_STARTING, _HANDSHAKE, _DECIDING):
            self._eof = True
            if self._state == _HANDSHAKE:
                assert self._conn is not None
                self._conn.receive_data(b"")
                self._pump_handshake()
            return True  # _DECIDING / _STARTING: looked at in their turn; the transport stays open
        if self._state == _LINKED:
            assert self._conn is not None
            self._conn.receive_data(b"")
            self._pump_link()
        return False

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        self._state = _ENDED
        self._port.served(self._transport or _NO_TRANSPORT, True)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the join link closed"))
            self._drained.exception()  # retrieved: nobody may be waiting
        if state == _LINKED:
            if exc is None:  # closed on this side (the run ended it): reported as an EOF
                self._end_link("host closed its join link", lost=False)
            else:
                self._end_link(f"join link broke: {exc!r}", lost=True)
            return
        if state != _ENDED:  # an ending on this side (refusal, Reject, overrun) was counted where it happened
            self._run.refuse(self._peer, "eof_before_hello", "the dialer closed before sending its hello")
        self._end_handshake()

    # --- the handshake ---------------------------------------------------------------------------

    def _start(self) -> None:
        """This side's turn: its nonce and keys, then whatever the dialer sent meanwhile."""
        if self._state != _STARTING:
            return
        transport = self._transport
        assert transport is not None
        self._conn = conn = FrameConnection(
            Role.LISTENER,
            self._run.join_key,
            max_payload=MAX_JOIN_PAYLOAD,
            max_tail=0,
            channel=Channel.JOIN,
        )
        if not self._port.inherited.nodelay:  # uvloop sets it on its transports; asyncio does not
            sock = tcp_socket(transport)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(conn.initial_bytes())
        self._state = _HANDSHAKE
        early, self._early = self._early, b""
        if early:
            conn.receive_data(early)
        if self._eof:
            conn.receive_data(b"")
        self._pump_handshake()

    def _pump_handshake(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            event = conn.next_event()
        except WireError as error:
            self._refuse_quietly(error.code, error.detail)
            return
        if isinstance(event, NeedData):
            return
        if isinstance(event, Closed):
            self._refuse_quietly("eof_before_hello", "the dialer closed before sending its hello")
            return
        # The first frame verified: the peer holds the key. Its bytes go back to the budget, and nothing
        # more is read until its hello is decided.
        self._settle()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._state = _DECIDING
        assert self._transport is not None
        with contextlib.suppress(RuntimeError, AttributeError):
            self._transport.pause_reading()
        join_turns(self._loop).call(lambda: self._decide(event))

    def _decide(self, frame: Frame) -> None:
        """The hello's turn: decode it and let the run decide."""
        if self._state != _DECIDING:
            return
        run = self._run
        run.counters.frame_in(CHANNEL, len(frame.payload))
        try:
            hello = frame.message()
        except WireError as error:
            self._reject("bad_payload", f"hello decode failed: {error.detail}")
            return
        if not isinstance(hello, Hello):
            self._reject(
                "expected_hello",
                f"the first join-channel message must be Hello, got {type(hello).__name__}",
            )
            return
        link = HostLink(hello.host, self, self._peer, self.local_address)
        accepted = run.admit(hello, link)
        if isinstance(accepted, Reject):
            self._send_and_close(accepted)
            return
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._state = _ENDED
            self._release_gate()
            run.link_closed(link, "accept write failed (the connection closed)", lost=True)
            return
        self._release_gate()
        self._link = link
        self._state = _LINKED
        # TCP keepalive on an admitted link: the join protocol is silent during training, so a host whose
        # network vanished (no FIN, no RST) would otherwise hold the run open for ever. Probes every idle/3 s
        # after `idle` s of silence; three unanswered ones end the read with an error, i.e. a lost link.
        # Set here only where the link did not inherit exactly these from the listening socket.
        idle = run.link_keepalive_secs
        if not self._port.inherited.keeps_alive(idle):
            keep_alive(transport, idle, user_timeout=False)
        _link_opened()
        with contextlib.suppress(RuntimeError, AttributeError):
            transport.resume_reading()
        if self._eof:
            assert self._conn is not None
            self._conn.receive_data(b"")
        self._pump_link()

    def _deadline_passed(self) -> None:
        self._timer = None
        if self._state in (_STARTING, _HANDSHAKE):
            timeout = self._run.handshake_timeout
            self._refuse_quietly("handshake_timeout", f"no hello within {timeout:g}s")

    def _overrun(self, code: str, detail: str) -> None:
        """Over the allowance or the budget: the port drops it (counted there, not as a join refusal)."""
        self._state = _ENDED
        assert self._transport is not None
        self._end_handshake()
        self._port.drop(self._transport, self._peer, code, detail)

    def _refuse_quietly(self, code: str, detail: str) -> None:
        """A frame-level failure (wrong key, garbage, silence): counted and logged, no reply."""
        self._state = _ENDED
        self._run.refuse(self._peer, code, detail)
        self._end_handshake()
        assert self._transport is not None
        self._transport.close()

    def _reject(self, code: str, reason: str) -> None:
        self._run.refuse(self._peer, code, reason)
        self._send_and_close(Reject(code=code, reason=reason[:1024]))

    def _send_and_close(self, message: Message) -> None:
        self._state = _ENDED
        with contextlib.suppress(ConnectionError, OSError, WireError):
            self.send_nowait(message)
            self._run.counters.frame_out(CHANNEL, 0)
        self._end_handshake()
        assert self._transport is not None
        self._transport.close()

    def _settle(self) -> None:
        if self._held >= 0:
            self._port.budget.give(self._held)
            self._held = -1  # settled: no more counting

    def _release_gate(self) -> None:
        if self._gate_held:
            self._gate_held = False
            self._run.release_gate(self._peer)

    def _end_handshake(self) -> None:
        self._settle()
        self._release_gate()
        self._early = b""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- the link --------------------------------------------------------------------------------

    def _pump_link(self) -> None:
        conn, link = self._conn, self._link
        assert conn is not None and link is not None
        while self._state == _LINKED:
            try:
                event = conn.next_event()
            except WireError as error:
                self._end_link(f"join link violated the protocol: {error}", lost=True)
                assert self._transport is not None
                self._transport.abort()
                return
            if isinstance(event, NeedData):
                return
            if isinstance(event, Closed):
                self._end_link("host closed its join link", lost=False)
                return
            self._run.counters.frame_in(CHANNEL, len(event.payload))
            try:
                message = event.message()
            except WireError as error:
                log.debug("event=join_frame_ignored host=%s detail=%r", link.host, error.detail)
                continue
            if type(message) in REPORTS:
                REPORTS.dispatch(message, self._run, link)
            else:
                log.debug("event=join_frame_ignored host=%s kind=%s", link.host, type(message).__name__)

    def _end_link(self, why: str, *, lost: bool) -> None:
        link = self._link
        if link is None:
            return
        self._link = None
        self._state = _ENDED
        _link_ended()
        try:
            self._run.link_closed(link, why, lost=lost)
        finally:
            if self._transport is not None and not self._transport.is_closing():
                self._transport.close()


class _NoTransport:
    """Stands for a transport a protocol never got (connection_lost without connection_made)."""


_NO_TRANSPORT = typing.cast(asyncio.BaseTransport, _NoTransport())
