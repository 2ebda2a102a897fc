"""The port mux over real loopback sockets: routing, deadlines, drops, the flood gate, HTTP hand-over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from flodld.controller.mux import MAGIC_DEADLINE_SECS, PortMux, PreAdmissionGate
from flodld.controller.status.metrics import ControllerCounters
from flodld.wire.magic import Channel, magic_prefix
from tests.flodld.controller.agents import server_transports


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    data = await reader.readexactly(5)
    writer.write(b"echo:" + data)
    await writer.drain()


async def _started(mux: PortMux) -> int:
    _, port = await mux.start("127.0.0.1", 0)
    return port


@asynccontextmanager
async def _echo_mux(
    magic_deadline: float = MAGIC_DEADLINE_SECS, gate: PreAdmissionGate | None = None
) -> AsyncIterator[tuple[PortMux, int]]:
    """A started mux that echoes the rendezvous channel (see _echo); closed after."""
    mux = PortMux(ControllerCounters(), magic_deadline=magic_deadline, gate=gate)
    mux.register(Channel.RENDEZVOUS, _echo)
    port = await _started(mux)
    try:
        yield mux, port
    finally:
        await mux.close()


@asynccontextmanager
async def _http_mux(*, http_lifetime: float) -> AsyncIterator[tuple[PortMux, int]]:
    """A started mux whose HTTP goes to an empty aiohttp app (every path answers 404)."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    assert runner.server is not None
    mux = PortMux(ControllerCounters(), http_lifetime=http_lifetime)
    mux.set_http(runner.server)
    port = await _started(mux)
    try:
        yield mux, port
    finally:
        await mux.close()
        await runner.cleanup()


async def _wait_for(predicate: Callable[[], object], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_routes_by_magic_with_bytes_after_the_magic_intact() -> None:
    async with _echo_mux() as (mux, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.RENDEZVOUS) + b"hello")  # magic and payload in one segment
        assert await asyncio.wait_for(reader.readexactly(10), 3) == b"echo:hello"
        writer.close()
        assert mux.counters.connections["rendezvous"] == 1


async def test_silent_connection_does_not_delay_another_and_is_dropped_at_the_deadline() -> None:
    async with _echo_mux(magic_deadline=0.5) as (mux, port):
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.RENDEZVOUS) + b"quick")
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.readexactly(10), 3) == b"echo:quick"
        assert asyncio.get_running_loop().time() - started < 0.4  # answered before the silent peer's deadline
        assert await asyncio.wait_for(silent_reader.read(), 3) == b""  # closed by the deadline
        assert mux.counters.dropped["deadline"] == 1
        silent_writer.close()
        writer.close()


async def test_the_magic_deadlines_of_many_connections_share_one_loop_timer_and_each_still_holds() -> None:
    """A timer per connection cost ~3 µs each in a join storm; the deadlines of one length now share one."""
    loop = asyncio.get_running_loop()
    async with _echo_mux(magic_deadline=0.4) as (mux, port):
        timers_before = len(loop._scheduled)  # type: ignore[attr-defined]  # asyncio's timer heap
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        await _wait_for(lambda: len(mux.deadlines(0.4)) == 30)
        assert len(loop._scheduled) - timers_before <= 1  # type: ignore[attr-defined]
        for reader, _ in silent:
            assert await asyncio.wait_for(reader.read(), 3) == b""  # each closed at its deadline
        assert mux.counters.dropped["deadline"] == 30
        assert len(mux.deadlines(0.4)) == 0
        for _, writer in silent:
            writer.close()


async def _closed_by_the_mux(reader: asyncio.StreamReader) -> None:
    """The mux closed this connection without a byte: EOF within 3 s, or a reset."""
    try:
        assert await asyncio.wait_for(reader.read(), 3) == b""
    except ConnectionResetError:
        pass


async def test_unknown_magic_is_dropped_and_counted_and_the_mux_keeps_routing() -> None:
    async with _echo_mux() as (mux, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xef\xbe\xad\xde")
        await _closed_by_the_mux(reader)
        writer.close()
        assert mux.counters.dropped["unknown_magic"] == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.RENDEZVOUS) + b"again")
        assert await asyncio.wait_for(reader.readexactly(10), 3) == b"echo:again"
        writer.close()


async def test_eof_before_magic_and_unserved_channel_are_dropped() -> None:
    mux = PortMux(ControllerCounters())
    port = await _started(mux)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xe3")
        writer.write_eof()
        reader, writer2 = await asyncio.open_connection("127.0.0.1", port)
        writer2.write(magic_prefix(Channel.DATA))
        await _closed_by_the_mux(reader)
        await _wait_for(lambda: mux.counters.dropped["truncated_magic"] == 1)
        assert mux.counters.dropped["no_handler"] == 1
        writer.close()
        writer2.close()
    finally:
        await mux.close()


async def test_pre_admission_gate_caps_pending_connections_per_address() -> None:
    async with _echo_mux(magic_deadline=2.0, gate=PreAdmissionGate(3, exempt_loopback=False)) as (mux, port):
        pending = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await _wait_for(lambda: mux.gate.pending("127.0.0.1") == 3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _closed_by_the_mux(reader)
        assert mux.counters.dropped["flood"] == 1
        # Once one pending peer routes, its slot frees up for a new connection.
        first_reader, first_writer = pending[0]
        first_writer.write(magic_prefix(Channel.RENDEZVOUS) + b"slot1")
        assert await asyncio.wait_for(first_reader.readexactly(10), 3) == b"echo:slot1"
        await _wait_for(lambda: mux.gate.pending("127.0.0.1") == 2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.RENDEZVOUS) + b"slot2")
        assert await asyncio.wait_for(reader.readexactly(10), 3) == b"echo:slot2"
        for _, w in pending:
            w.close()
        writer.close()


async def test_http_is_handed_to_aiohttp_on_the_same_port() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "query": request.query_string})

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    mux = PortMux(ControllerCounters())
    assert runner.server is not None
    mux.set_http(runner.server)
    port = await _started(mux)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x?y=1 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), 3)
        assert response.startswith(b"HTTP/1.1 200")
        assert response.endswith(b'{"path": "/x", "query": "y=1"}')
        writer.close()
        assert mux.counters.connections["http"] == 1
    finally:
        await mux.close()
        await runner.cleanup()


async def test_a_slow_http_head_is_cut_at_the_http_lifetime() -> None:
    async with _http_mux(http_lifetime=0.4) as (mux, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /state.json HTTP/1.1\r\nX-Slow: ")  # and never finish the head
        started = asyncio.get_running_loop().time()
        await _closed_by_the_mux(reader)
        assert asyncio.get_running_loop().time() - started < 2
        assert mux.counters.dropped["http_lifetime"] == 1
        writer.close()


async def test_finished_http_connections_are_released_before_their_lifetime_ends() -> None:
    """A pending lifetime timer must not keep a closed connection (and its buffers) alive."""
    async with _http_mux(http_lifetime=60) as (mux, port):
        before = server_transports(port)
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 3)).startswith(b"HTTP/1.1 404")
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.2)
        assert server_transports(port) - before < 5
        assert mux.counters.connections["http"] == 40 and not mux.counters.dropped
