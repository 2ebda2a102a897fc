"""One HTTP connection on the controller port, after the mux routed it: its fixed lifetime, the direct
answer to a plain `GET /state.json` (`flodld.controller.status.fastget`), the hand-over to aiohttp for
anything else, and the answer bytes it leaves queued, counted against the port's HTTP write budget.

HTTP is unauthenticated end to end, so the bytes an HTTP answer leaves queued in its transport (a reader
that reads slowly or not at all) count against one global budget (`PortMux.http_budget`) with a
per-address share of a quarter of it: an answer that would queue past either is cut at once and counted
(`http_budget`), not queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections import Counter
from collections.abc import Callable

from flodld.controller.status.fastget import Direct, HeadReader, Verdict
from flodld.net.deadlines import Deadline
from flodld.net.preauth import PreAuthBudget

HttpProtocolFactory = Callable[[], asyncio.Protocol]
Drop = Callable[[asyncio.BaseTransport, str, str, str], None]
"""`drop(transport, peer, reason, detail)`: count, log and abort a connection."""

HTTP_WRITE_BUDGET_BYTES = 64 * 1024 * 1024
"""Answer bytes queued for HTTP readers, all connections together (`PortMux.http_budget`): 64 MiB holds a
dozen 5 MB `?members=all` pages in flight; past it an answer is cut, not queued."""
HTTP_PEER_SHARE = 4
"""One address may hold at most 1/HTTP_PEER_SHARE of the HTTP write budget: slow readers from one source
cannot take all of it from everyone else."""



class HttpQueued:
    """One HTTP connection's answer bytes waiting in its transport, counted against the port's `http_budget`
    and its peer's share of it.

    Once watched (`watch`: a connection handed to aiohttp, or a direct answer that left bytes queued), the
    transport's write-buffer limits are zero, so it reports (`pause_writing`) as soon as a write leaves
    anything queued and again (`resume_writing`) once all of it is sent: `recount` at those points, after
    a direct answer is written, and at the end (`release`) keeps the count equal to what is queued (a
    direct answer the socket took whole costs one look at the buffer). Bytes that would go past the budget
    or the peer's share cut the connection (counted `http_budget`); the abort frees them in the same turn.
    """

    def __init__(
        self,
        budget: PreAuthBudget,
        by_peer: Counter[str],
        transport: asyncio.Transport,
        peer: str,
        drop: Drop,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """`budget` and `by_peer` (queued bytes per address) are the port's, shared by its connections;
        `drop` counts, logs and aborts a connection cut for the budget.
        """
        self._budget = budget
        self._by_peer = by_peer
        self._drop = drop
        self._loop = loop
        self._transport = transport
        self._peer = peer
        self.held = 0
        self._cut = False

    def watch(self) -> None:
        """Be told of every byte left queued, and of the queue emptying."""
        with contextlib.suppress(Exception):  # a transport without limits (none of ours) is recounted less
            self._transport.set_write_buffer_limits(high=0, low=0)

    def recount(self) -> None:
        if self._cut:
            return
        size = self._transport.get_write_buffer_size()
        if size == self.held:
            return
        more = size - self.held
        if more > 0:
            share = self._budget.limit // HTTP_PEER_SHARE
            if self._by_peer[self._peer] + more > share:
                self._refuse(f"answers queued for this address would exceed its share ({share} bytes)")
                return
            if not self._budget.take(more):
                self._refuse(f"the HTTP write budget of {self._budget.limit} bytes is spent")
                return
        else:
            self._budget.give(-more)
        self._by_peer[self._peer] += more
        self.held = size

    def recount_soon(self) -> None:
        """`recount` at the end of this turn (from inside a transport's write, where an abort does not go)."""
        self._loop.call_soon(self.recount)

    def release(self) -> None:
        """The connection ended: give back everything it held."""
        self._cut = True
        if self.held:
            self._budget.give(self.held)
            self._by_peer[self._peer] -= self.held
            self.held = 0
        if self._by_peer[self._peer] <= 0:
            self._by_peer.pop(self._peer, None)

    def _refuse(self, detail: str) -> None:
        self._cut = True
        self._drop(self._transport, self._peer, "http_budget", detail)


class LimitedLifetime(asyncio.Protocol):
    """An HTTP connection: aiohttp's protocol, its lifetime timer cancelled as soon as the connection ends.

    Left pending, each timer would keep its closed connection (transport, handler, buffers) alive
    for the whole lifetime: under a busy poller that is thousands of dead connections held at once,
    and a process high-water mark that malloc never gives back (measured: +3 MiB RSS per 2000
    requests that never came down).

    With `direct` (a GET, on a port with a state.json source), the request head is read here first
    (`HeadReader`): a plain `GET /state.json` gets `direct`'s answer and the connection closes, without
    aiohttp; anything else gets aiohttp's protocol, fed every byte read so far, as if it had read them
    itself. The timer bounds the connection either way (a head trickling in is cut like any slow request,
    an answer its reader does not take is cut with it), and `queued` counts what its answers leave queued.
    """

    def __init__(
        self,
        factory: HttpProtocolFactory,
        timer: Deadline,
        direct: Callable[[Direct, str], tuple[bytes, bytes] | None] | None = None,
        queued: HttpQueued | None = None,
        peer: str = "?",
    ) -> None:
        self.timer = timer
        self._peer = peer
        self._queued = queued
        self._factory = factory
        self._direct = direct
        self._head = HeadReader() if direct is not None else None
        self._transport: asyncio.Transport | None = None
        self.inner: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        if self._head is None:
            self._hand_over(b"")

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        if self._head is None:  # answered directly: the connection is closing
            return
        assert self._direct is not None and self._transport is not None
        verdict = self._head.feed(data)
        if verdict is Verdict.MORE:
            return
        if isinstance(verdict, Direct) and (answer := self._direct(verdict, self._peer)) is not None:
            self._head = None
            self._transport.writelines(answer)
            if self._queued is not None and self._transport.get_write_buffer_size():
                self._queued.recount()
                self._queued.watch()
            self._transport.close()
            return
        self._hand_over(bytes(self._head.head))

    def _hand_over(self, buffered: bytes) -> None:
        assert self._transport is not None
        self._head = None
        if self._queued is not None:
            self._queued.watch()
        self.inner = self._factory()
        self.inner.connection_made(self._transport)
        if buffered:
            self.inner.data_received(buffered)

    def eof_received(self) -> bool | None:
        if self.inner is None and self._head is not None:  # a head cut short: aiohttp's, as before
            self._hand_over(bytes(self._head.head))
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        # Called from inside the transport's write: the count (and a cut) waits for the turn's end.
        if self._queued is not None:
            self._queued.recount_soon()
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._queued is not None:
            self._queued.recount()
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()
        if self._queued is not None:
            self._queued.release()
        if self.inner is not None:
            self.inner.connection_lost(exc)
