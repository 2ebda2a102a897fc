"""The join channel: handshake a dialer, hand its Hello to the run, then supervise the link.

Per connection: nonce exchange and the first frame under the handshake deadline. Frame-level
failures (wrong salt, garbage, silence) get no reply, only a log line and a counted refusal;
a well-formed but unacceptable hello gets a Reject. Once admitted, the same connection carries
WorldFormed/Abort down and RankExited up, and its EOF is the host's exit event.

Where a connection stands is a `JoinState`, changed only through a row of `TRANSITIONS`: the
handshake never goes back, and an ended connection stays ended. The transport half (pre-authentication
accounting, the handshake deadline, write backpressure) is `flodld.net.gated.GatedProtocol`; the turn
budget the CPU-bound steps wait on is `flodld.net.turns`; the collector's storm policy is
`flodld.controller.linkheap`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from flodld.controller.linkheap import link_ended, link_opened
from flodld.controller.status.metrics import ControllerCounters
from flodld.net.gated import GatedProtocol, ShellPort
from flodld.net.keepalive import keep_alive, tcp_socket
from flodld.net.turns import join_turns
from flodld.wire.errors import WireError
from flodld.wire.frames import Closed, Frame, FrameConnection, NeedData, Role
from flodld.wire.handlers import HandlerTable
from flodld.wire.join import Accept, Hello, RankExited, Reject, Stopped
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

log = logging.getLogger("flodld.controller.join")

CHANNEL = "join"
MAX_JOIN_PAYLOAD = 1024 * 1024
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
    hello: Hello | None = None
    """The hello it was admitted with: what re-admits it, unchanged, into the next attempt (`Reform`)."""


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

    def host_stopped(self, link: HostLink) -> None:
        """After a `Reform`: the host's ranks are gone and it waits on the link for the next attempt."""


REPORTS: HandlerTable[[JoinRun, HostLink], None] = HandlerTable("join-link report")
"""What an admitted host may send up its join link; any other kind is logged and ignored."""


@REPORTS.handles(RankExited)
def _rank_exited(message: RankExited, controller: JoinRun, link: HostLink) -> None:
    controller.rank_exited(link, message.rank, message.code, message)


@REPORTS.handles(Stopped)
def _stopped(message: Stopped, controller: JoinRun, link: HostLink) -> None:
    controller.host_stopped(link)


JoinPort = ShellPort
"""What a `JoinProtocol` asks of the port that routed it to the join channel (the `PortMux`)."""


class JoinState(Enum):
    """Where a join connection stands."""

    STARTING = "starting"  # routed, waiting for its turn to write its nonce
    HANDSHAKE = "handshake"  # nonce written; reading the dialer's nonce and first frame under the deadline
    DECIDING = "deciding"  # first frame verified; waiting for its turn to be decided (reading paused)
    LINKED = "linked"  # admitted: WorldFormed/Abort down, RankExited up, until either side closes
    ENDED = "ended"


class JoinStep(Enum):
    """What moves a join connection on."""

    TURN = "turn"  # this side's turn came: its nonce is written
    VERIFIED = "verified"  # the dialer's first frame verified
    ADMITTED = "admitted"  # the run admitted the hello
    END = "end"  # refused, rejected, overrun, timed out, closed or lost


TRANSITIONS: dict[tuple[JoinState, JoinStep], JoinState] = {
    (JoinState.STARTING, JoinStep.TURN): JoinState.HANDSHAKE,
    (JoinState.HANDSHAKE, JoinStep.VERIFIED): JoinState.DECIDING,
    (JoinState.DECIDING, JoinStep.ADMITTED): JoinState.LINKED,
    **{(state, JoinStep.END): JoinState.ENDED for state in JoinState},  # ENDED -> ENDED: an ending is final
}
"""Every move a join connection may make; any other is a bug (`JoinProtocol._move` asserts it)."""

HANDSHAKING = frozenset({JoinState.STARTING, JoinState.HANDSHAKE, JoinState.DECIDING})


class JoinProtocol(GatedProtocol):
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

    __slots__ = ("_conn", "_early", "_eof", "_gate_held", "_link", "_run", "_state", "local_address")

    def __init__(self, run: JoinRun, port: JoinPort, peer: str) -> None:
        super().__init__(port, peer)
        self._run = run
        self._state = JoinState.STARTING
        self._conn: FrameConnection | None = None
        self._early = b""  # bytes that came before this side's turn to start
        self._eof = False
        self._gate_held = True
        self._link: HostLink | None = None
        self.local_address = run.advertised_host

    def _move(self, step: JoinStep) -> JoinState:
        """Take `step` through `TRANSITIONS` (the only place the state changes)."""
        moved = TRANSITIONS.get((self._state, step))
        assert moved is not None, f"join connection: no move {step.name} from {self._state.name}"
        self._state = moved
        return moved

    # --- LinkStream ------------------------------------------------------------------------------

    @property
    def conn(self) -> FrameConnection:
        assert self._conn is not None
        return self._conn

    def send_nowait(self, msg: Message) -> None:
        assert self._conn is not None and self._transport is not None
        self._transport.write(self._conn.send_message(msg))

    async def drain(self) -> None:
        if self._transport is None or self._state is JoinState.ENDED:
            raise ConnectionResetError("the join link is closed")
        await super().drain()

    def rekey(self, salt: bytes) -> None:
        self.conn.rekey(salt)

    # --- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.attach(transport)
        sockname = transport.get_extra_info("sockname")
        if sockname:
            self.local_address = str(sockname[0])
        self.start_deadline(self._run.handshake_timeout, self._deadline_passed)
        join_turns(self._loop).call(self._start)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state is JoinState.LINKED:
            assert self._conn is not None
            self._conn.receive_data(data)
            self._pump_link()
            return
        if state is JoinState.ENDED:
            return
        refusal = self.charge(data)  # pre-authentication: count before holding anything
        if refusal is not None:
            self._overrun(*refusal)
            return
        if self._conn is None:
            self._early += data
            return
        self._conn.receive_data(data)
        if state is JoinState.HANDSHAKE:
            self._pump_handshake()

    def eof_received(self) -> bool:
        if self._state in HANDSHAKING:
            self._eof = True
            if self._state is JoinState.HANDSHAKE:
                assert self._conn is not None
                self._conn.receive_data(b"")
                self._pump_handshake()
            return True  # DECIDING / STARTING: looked at in their turn; the transport stays open
        if self._state is JoinState.LINKED:
            assert self._conn is not None
            self._conn.receive_data(b"")
            self._pump_link()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        self._move(JoinStep.END)
        self.detach()
        if state is JoinState.LINKED:
            if exc is None:  # closed on this side (the run ended it): reported as an EOF
                self._end_link("host closed its join link", lost=False)
            else:
                self._end_link(f"join link broke: {exc!r}", lost=True)
            return
        if state is not JoinState.ENDED:  # an ending here (refusal, Reject, overrun) was counted then
            self._run.refuse(self._peer, "eof_before_hello", "the dialer closed before sending its hello")
        self._end_handshake()

    # --- the handshake ---------------------------------------------------------------------------

    def _start(self) -> None:
        """This side's turn: its nonce and keys, then whatever the dialer sent meanwhile."""
        if self._state is not JoinState.STARTING:
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
        self._move(JoinStep.TURN)
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
        self.settle()
        self.cancel_deadline()
        self._move(JoinStep.VERIFIED)
        assert self._transport is not None
        with contextlib.suppress(RuntimeError, AttributeError):
            self._transport.pause_reading()
        join_turns(self._loop).call(lambda: self._decide(event))

    def _decide(self, frame: Frame) -> None:
        """The hello's turn: decode it and let the run decide."""
        if self._state is not JoinState.DECIDING:
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
        link = HostLink(hello.host, self, self._peer, self.local_address, hello=hello)
        accepted = run.admit(hello, link)
        if isinstance(accepted, Reject):
            self._send_and_close(accepted)
            return
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            self._move(JoinStep.END)
            self._release_gate()
            run.link_closed(link, "accept write failed (the connection closed)", lost=True)
            return
        self._release_gate()
        self._link = link
        self._move(JoinStep.ADMITTED)
        # TCP keepalive on an admitted link: the join protocol is silent during training, so a host whose
        # network vanished (no FIN, no RST) would otherwise hold the run open for ever. Probes every idle/3 s
        # after `idle` s of silence; three unanswered ones end the read with an error, i.e. a lost link.
        # Set here only where the link did not inherit exactly these from the listening socket.
        idle = run.link_keepalive_secs
        if not self._port.inherited.keeps_alive(idle):
            keep_alive(transport, idle, user_timeout=False)
        link_opened()
        with contextlib.suppress(RuntimeError, AttributeError):
            transport.resume_reading()
        if self._eof:
            assert self._conn is not None
            self._conn.receive_data(b"")
        self._pump_link()

    def _deadline_passed(self) -> None:
        self.deadline_fired()
        if self._state in (JoinState.STARTING, JoinState.HANDSHAKE):
            timeout = self._run.handshake_timeout
            self._refuse_quietly("handshake_timeout", f"no hello within {timeout:g}s")

    def _overrun(self, code: str, detail: str) -> None:
        """Over the allowance or the budget: the port drops it (counted there, not as a join refusal)."""
        self._move(JoinStep.END)
        self._end_handshake()
        self.drop(code, detail)

    def _refuse_quietly(self, code: str, detail: str) -> None:
        """A frame-level failure (wrong key, garbage, silence): counted and logged, no reply."""
        self._move(JoinStep.END)
        self._run.refuse(self._peer, code, detail)
        self._end_handshake()
        assert self._transport is not None
        self._transport.close()

    def _reject(self, code: str, reason: str) -> None:
        self._run.refuse(self._peer, code, reason)
        self._send_and_close(Reject(code=code, reason=reason[:1024]))

    def _send_and_close(self, message: Message) -> None:
        self._move(JoinStep.END)
        with contextlib.suppress(ConnectionError, OSError, WireError):
            self.send_nowait(message)
            self._run.counters.frame_out(CHANNEL, 0)
        self._end_handshake()
        assert self._transport is not None
        self._transport.close()

    def _release_gate(self) -> None:
        if self._gate_held:
            self._gate_held = False
            self._run.release_gate(self._peer)

    def _end_handshake(self) -> None:
        self.settle()
        self._release_gate()
        self._early = b""
        self.cancel_deadline()

    # --- the link --------------------------------------------------------------------------------

    def hand_over(self, run: JoinRun) -> HostLink | None:
        """A linked host kept across a restart goes to the next attempt's run: its reports and its end are
        that run's from now on, on a fresh `HostLink` (same host, hello and peer); None if the link ended.
        """
        old = self._link
        if old is None or self._state is not JoinState.LINKED or old.hello is None:
            return None
        self._run = run
        self._link = HostLink(old.host, self, old.peer, old.local_address, hello=old.hello)
        return self._link

    def _pump_link(self) -> None:
        conn, link = self._conn, self._link
        assert conn is not None and link is not None
        while self._state is JoinState.LINKED:
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
        self._move(JoinStep.END)
        link_ended()
        try:
            self._run.link_closed(link, why, lost=lost)
        finally:
            if self._transport is not None and not self._transport.is_closing():
                self._transport.close()
