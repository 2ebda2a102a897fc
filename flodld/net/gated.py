"""The transport half of a channel protocol served on the port's own transport (no stream, no task):
what `GatedReader` and `FramedStream` give a stream channel, for a bare `asyncio.Protocol`.

`GatedProtocol` owns, for one connection:
- pre-authentication accounting: until `settle()` (the first frame verified), every byte received is
  charged against the per-connection allowance and the port's global budget (`flodld.net.preauth`); an
  overrun ends the connection through the port (`drop`), counted there;
- the handshake deadline, from the port's shared `DeadlineQueue`;
- write backpressure: `pause_writing`/`resume_writing` and a `drain()` bounded by `WRITE_STALL_SECS`;
- the port's bookkeeping of live connections (`served`), so closing the port aborts them.
The channel's meaning (what a frame is, who decides) is the subclass's: it calls `charge`, `settle`,
`start_deadline` and `cancel_deadline` at its own steps.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable
from typing import Protocol

from flodld.net.deadlines import Deadline, DeadlineQueue
from flodld.net.keepalive import Inherited
from flodld.net.preauth import PreAuthBudget, charge
from flodld.net.stream import WRITE_STALL_SECS
from flodld.net.timeouts import scaled


class ShellPort(Protocol):
    """What a `GatedProtocol` asks of the port that routed it to its channel (the controller's `PortMux`)."""

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


class GatedProtocol(asyncio.Protocol):
    """A connection's transport, pre-authentication count, deadline and write backpressure (see the
    module docstring).
    """

    __slots__ = ("_drained", "_held", "_loop", "_paused", "_peer", "_port", "_timer", "_transport")

    def __init__(self, port: ShellPort, peer: str) -> None:
        self._port = port
        self._peer = peer
        self._transport: asyncio.Transport | None = None
        self._held = 0  # pre-authentication bytes counted against the budget (-1 once settled)
        self._timer: Deadline | None = None
        self._paused = False  # the transport's write buffer is over its high-water mark
        self._drained: asyncio.Future[None] | None = None
        self._loop = port.loop or asyncio.get_running_loop()

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    # --- the connection's life -------------------------------------------------------------------

    def attach(self, transport: asyncio.BaseTransport) -> asyncio.Transport:
        """`connection_made`'s part: keep the transport and tell the port it is served here."""
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's do not subclass Transport
        self._port.served(transport, False)
        return self._transport

    def detach(self) -> None:
        """`connection_lost`'s part: the port forgets it; a writer waiting in `drain` gets the reset."""
        self._port.served(self._transport or _NO_TRANSPORT, True)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the connection closed"))
            self._drained.exception()  # retrieved: nobody may be waiting

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # --- the deadline ----------------------------------------------------------------------------

    def start_deadline(self, timeout: float, passed: Callable[[], None]) -> None:
        self._timer = self._port.deadlines(timeout).call(passed)

    def cancel_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def deadline_fired(self) -> None:
        """The deadline's callback ran: nothing left to cancel."""
        self._timer = None

    # --- pre-authentication ----------------------------------------------------------------------

    def charge(self, data: bytes) -> tuple[str, str] | None:
        """Count `data` while not settled; the refusal (code, detail) when it goes over, nothing taken."""
        if self._held >= 0 and data:
            refusal = charge(self._port.budget, self._held, len(data))
            if refusal is not None:
                return refusal
            self._held += len(data)
        return None

    def settle(self) -> None:
        """The peer proved the key (or the connection ended): its bytes go back to the budget, and no more
        are counted.
        """
        if self._held >= 0:
            self._port.budget.give(self._held)
            self._held = -1

    def drop(self, code: str, detail: str) -> None:
        """Over the allowance or the budget: the port counts, logs and aborts it."""
        assert self._transport is not None
        self._port.drop(self._transport, self._peer, code, detail)

    # --- write backpressure ----------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Until what was written is handed to the socket (at most `WRITE_STALL_SECS`, scaled)."""
        if not self._paused:
            return
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()
        async with asyncio.timeout(scaled(WRITE_STALL_SECS)):
            await asyncio.shield(self._drained)

    def write_buffered(self) -> bool:
        """Whether bytes written still wait in the transport."""
        transport = self._transport
        return transport is None or transport.is_closing() or transport.get_write_buffer_size() > 0


class _NoTransport:
    """Stands for a transport a protocol never got (connection_lost without connection_made)."""


_NO_TRANSPORT = typing.cast(asyncio.BaseTransport, _NoTransport())
