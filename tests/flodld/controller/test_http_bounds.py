"""Issue 29 (2): every HTTP answer ends at `http_lifetime`, whichever path serves it, and the answer bytes
queued for readers that do not read count against one global budget (and a per-address share of it).

Over real sockets on loopback: the readers set a small SO_RCVBUF and never read, so a large answer stays
queued in the controller's transport; the queued bytes are measured from the transports themselves.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from flodld.config.join import JoinConfig
from flodld.controller.mux import PortMux
from flodld.controller.run import Controller
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.status.snapshot import DEFAULT_MEMBERS, MemberRange
from flodld.net.preauth import PreAuthBudget
from tests.flodld.controller.agents import join, options, started

BODY = b'{"members":[' + b'"x",' * (2 << 20) + b'"x"]}'  # ~8 MiB: far more than the sockets buffer
# flodld.controller.status.httpconn.HTTP_PEER_SHARE: an address holds a quarter of the budget
HTTP_PEER_SHARE = 4
POLL = b"GET /state.json HTTP/1.1\r\nHost: t\r\n\r\n"
VIA_AIOHTTP = b"GET /big HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"  # the same body, via aiohttp


@asynccontextmanager
async def _port(*, lifetime: float = 60.0, budget: int | None = None) -> AsyncIterator[tuple[PortMux, int]]:
    """A port answering `GET /state.json` directly with BODY, and `GET /big` through aiohttp with it."""

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    mux = PortMux(ControllerCounters(), http_lifetime=lifetime)
    if budget is not None:
        mux.http_budget = PreAuthBudget(budget)

    def state_body(_: MemberRange, __: str) -> bytes:
        return BODY

    assert runner.server is not None
    mux.set_http(runner.server, state_body=state_body)
    _, port = await mux.start("127.0.0.1", 0)
    try:
        yield mux, port
    finally:
        await mux.close()
        await runner.cleanup()


async def _never_reads(port: int, request: bytes, source: str = "127.0.0.1") -> socket.socket:
    """A client that sends `request` and never reads (a tiny receive buffer: the answer stays with us)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(sock, request)
    return sock


def _server_transports(port: int) -> list[asyncio.Transport]:
    """The port's connections still open or closing (not yet lost: their socket is not closed)."""
    gc.collect()
    return [
        o for o in gc.get_objects()
        if isinstance(o, asyncio.Transport) and o.get_extra_info("sockname", ("", 0))[1] == port
        and o.get_extra_info("socket") is not None and o.get_extra_info("socket").fileno() >= 0
    ]  # fmt: skip


def _queued(port: int) -> int:
    """Answer bytes queued in the port's live transports (read from the transports, not our accounting)."""
    return sum(t.get_write_buffer_size() for t in _server_transports(port))


async def _settle() -> None:
    """Let the port read the requests, write the answers and count them."""
    for _ in range(5):
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("request_bytes", [POLL, VIA_AIOHTTP], ids=["direct", "aiohttp"])
async def test_an_answer_its_reader_never_takes_is_cut_at_the_http_lifetime(request_bytes: bytes) -> None:
    async with _port(lifetime=0.5) as (mux, port):
        sock = await _never_reads(port, request_bytes)
        try:
            await _settle()
            assert _queued(port) > 1 << 20, "the answer should be waiting for its reader"
            await asyncio.sleep(1.0)  # past the lifetime
            assert mux.counters.dropped["http_lifetime"] == 1
            assert _queued(port) == 0
            assert not _server_transports(port), "the connection outlived http_lifetime"
            assert mux.http_budget.used == 0
        finally:
            sock.close()


def _queued_by_source(port: int) -> dict[str, int]:
    by_source: dict[str, int] = {}
    for transport in _server_transports(port):
        source = transport.get_extra_info("peername")[0]
        by_source[source] = by_source.get(source, 0) + transport.get_write_buffer_size()
    return by_source


@pytest.mark.parametrize("request_bytes", [POLL, VIA_AIOHTTP], ids=["direct", "aiohttp"])
async def test_slow_readers_cannot_make_the_port_queue_more_than_the_http_budget(
    request_bytes: bytes,
) -> None:
    budget = 48 << 20
    share = budget // HTTP_PEER_SHARE
    async with _port(budget=budget) as (mux, port):
        sources = [f"127.0.0.{i}" for i in range(2, 2 + HTTP_PEER_SHARE - 1)]
        socks = []
        try:
            for i in range(8 * len(sources)):
                socks.append(await _never_reads(port, request_bytes, sources[i % len(sources)]))
            await _settle()
            by_source = _queued_by_source(port)
            queued = sum(by_source.values())
            assert queued <= budget, f"{queued} bytes queued for readers, over the {budget}-byte budget"
            assert all(held <= share for held in by_source.values()), (by_source, share)
            assert mux.http_budget.used == queued
            assert mux.counters.dropped["http_budget"] > 0
            # A poll from another address, reading at once, still gets the whole answer.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes)
            response = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert response.startswith(b"HTTP/1.1 200 ") and response.endswith(BODY)
        finally:
            for sock in socks:
                sock.close()
        await _settle()
        assert mux.http_budget.used == 0


async def test_a_join_is_admitted_while_slow_readers_hold_the_http_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def big_state(
        self: Controller, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None
    ) -> bytes:
        del self, members, source
        return BODY

    monkeypatch.setattr(Controller, "state_body", big_state)
    controller, port = await started(options(capacity=4, join=JoinConfig(join_timeout=30)))
    controller.mux.http_budget = PreAuthBudget(32 << 20)
    socks = []
    try:
        for i in range(40):
            socks.append(await _never_reads(port, POLL, f"127.0.0.{2 + i % HTTP_PEER_SHARE}"))
        await _settle()
        assert controller.mux.http_budget.used > 16 << 20
        assert controller.counters.dropped["http_budget"] > 0
        agent = await join(port, controller.salt, "legit")
        assert agent.accepted
        await agent.stream.aclose()
    finally:
        for sock in socks:
            sock.close()
        await controller.close()
