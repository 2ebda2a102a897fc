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
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from flodld.controller.metrics import ControllerCounters
from flodld.net.preauth import GatedReader
from flodld.net.stream import FramedStream, accept_channel
from flodld.wire.errors import WireError
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
JOIN_STEPS_PER_TURN = 32


class TurnBudget:
    """At most `per_turn` callers of `take()` go on per event-loop turn; the others wait, in order, for
    later turns. Sans-io apart from the loop's `call_soon` and futures.
    """

    def __init__(self, per_turn: int) -> None:
        if per_turn < 1:
            raise ValueError(f"a turn budget lets >= 1 step through, got {per_turn}")
        self.per_turn = per_turn
        self._used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._refill_scheduled = False
        self.deferred = 0
        """How many steps waited for a later turn (for tests and diagnostics)."""

    async def take(self) -> None:
        if self._used < self.per_turn and not self._waiters:
            self._used += 1
            self._schedule_refill()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.deferred += 1
        self._schedule_refill()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._used -= 1  # woken and counted, then cancelled: give the step back
            raise

    def _schedule_refill(self) -> None:
        if not self._refill_scheduled:
            self._refill_scheduled = True
            asyncio.get_running_loop().call_soon(self._refill)

    def _refill(self) -> None:
        """Runs once per turn while anything is counted or waiting: a new turn's budget, first to waiters."""
        self._refill_scheduled = False
        self._used = 0
        while self._waiters and self._used < self.per_turn:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._used += 1
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


def join_turns() -> TurnBudget:
    """The running loop's join-step budget (one per loop: every run on a controller port shares it)."""
    global _LAST
    loop = asyncio.get_running_loop()
    last = _LAST
    if last is not None and last[0]() is loop:
        return last[1]
    budget = _BUDGETS.get(loop)
    if budget is None:
        budget = _BUDGETS[loop] = TurnBudget(JOIN_STEPS_PER_TURN)
    _LAST = (weakref.ref(loop), budget)
    return budget


@dataclass
class HostLink:
    """An admitted host's join connection."""

    host: str
    stream: FramedStream
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

    def rank_exited(self, link: HostLink, rank: int, code: int) -> None:
        """The host reported a rank's exit code."""

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None:
        """The link ended.

        Cleanly (`lost=False`: the host closed it) or not (reset, bad frame, failed write).
        """


async def handle_join(
    controller: JoinRun, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """The mux handler for the join channel (bound to a run, e.g. the Controller)."""
    peername = writer.get_extra_info("peername")
    sockname = writer.get_extra_info("sockname")
    peer = str(peername[0]) if peername else "?"
    local_address = str(sockname[0]) if sockname else controller.advertised_host
    timeout = controller.handshake_timeout
    turns = join_turns()
    gate_held = True
    try:
        try:
            await turns.take()  # before the nonce exchange: this side's nonce, then the keys
            stream = await accept_channel(
                reader,
                writer,
                controller.join_key,
                channel=Channel.JOIN,
                timeout=timeout,
                max_payload=MAX_JOIN_PAYLOAD,
                max_tail=0,
            )
            frame = await stream.recv(timeout)
            await turns.take()  # before the hello's decoding and its admission
        except WireError as error:
            controller.refuse(peer, error.code, error.detail)
            return
        except (EOFError, asyncio.IncompleteReadError, ConnectionError):
            if not (isinstance(reader, GatedReader) and reader.refused):  # else the mux counted its overrun
                controller.refuse(peer, "eof_before_hello", "the dialer closed before sending its hello")
            return
        except TimeoutError:
            controller.refuse(peer, "handshake_timeout", f"no hello within {timeout:g}s")
            return
        controller.counters.frame_in(CHANNEL, len(frame.payload))
        try:
            hello = frame.message()
        except WireError as error:
            await _reject(controller, stream, peer, "bad_payload", f"hello decode failed: {error.detail}")
            return
        if not isinstance(hello, Hello):
            await _reject(
                controller,
                stream,
                peer,
                "expected_hello",
                f"the first join-channel message must be Hello, got {type(hello).__name__}",
            )
            return
        link = HostLink(hello.host, stream, peer, local_address)
        accepted = controller.admit(hello, link)
        if isinstance(accepted, Reject):
            await _send_quietly(controller, stream, accepted)
            return
        try:
            await stream.drain()
        except (ConnectionError, TimeoutError, OSError) as error:
            controller.link_closed(link, f"accept write failed ({error!r})", lost=True)
            return
        controller.release_gate(peer)
        gate_held = False
        await turns.take()  # before the link's set-up (keepalive, its first read)
        _keepalive(writer, controller.link_keepalive_secs)
        _link_opened()
        try:
            await _supervise(controller, link)
        finally:
            _link_ended()
    finally:
        if gate_held:
            controller.release_gate(peer)


def _keepalive(writer: asyncio.StreamWriter, idle: float) -> None:
    """TCP keepalive on an admitted link: the join protocol is silent during training, so a host whose
    network vanished (no FIN, no RST) would otherwise hold the run open for ever. Probes every idle/3 s
    after `idle` s of silence; three unanswered ones end the read with an error, i.e. a lost link.
    """
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError, AttributeError):  # the TCP_KEEP* names are Linux/BSD only
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(idle)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(idle / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


REPORTS: HandlerTable[[JoinRun, HostLink], None] = HandlerTable("join-link report")
"""What an admitted host may send up its join link; any other kind is logged and ignored."""


@REPORTS.handles(RankExited)
def _rank_exited(message: RankExited, controller: JoinRun, link: HostLink) -> None:
    controller.rank_exited(link, message.rank, message.code)


async def _supervise(controller: JoinRun, link: HostLink) -> None:
    """Read RankExited reports until the host closes its side (or the link breaks)."""
    why, lost = "link closed", True
    try:
        while True:
            frame = await link.stream.recv()
            controller.counters.frame_in(CHANNEL, len(frame.payload))
            try:
                message = frame.message()
            except WireError as error:
                log.debug("event=join_frame_ignored host=%s detail=%r", link.host, error.detail)
                continue
            if type(message) in REPORTS:
                REPORTS.dispatch(message, controller, link)
            else:
                log.debug("event=join_frame_ignored host=%s kind=%s", link.host, type(message).__name__)
    except EOFError:
        why, lost = "host closed its join link", False
    except WireError as error:
        why = f"join link violated the protocol: {error}"
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as error:
        why = f"join link broke: {error!r}"
    finally:
        controller.link_closed(link, why, lost=lost)


async def _reject(controller: JoinRun, stream: FramedStream, peer: str, code: str, reason: str) -> None:
    controller.refuse(peer, code, reason)
    await _send_quietly(controller, stream, Reject(code=code, reason=reason[:1024]))


async def _send_quietly(controller: JoinRun, stream: FramedStream, message: Message) -> None:
    with contextlib.suppress(ConnectionError, TimeoutError, OSError):
        await stream.send(message)
        controller.counters.frame_out(CHANNEL, 0)
