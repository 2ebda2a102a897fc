"""Slowloris and connection floods against a real `flodld serve` process.

Stated bounds: with 1,000 hostile connections open (idle, byte-at-a-time HTTP heads, byte-at-a-time join
handshakes), a state.json request answers within FLOOD_BOUND_SECS and a legitimate join is accepted within
FLOOD_BOUND_SECS; pre-magic connections are cut at the mux deadline; the daemon's fds return to baseline.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from flodld.net.stream import open_channel
from flodld.wire.join import Accept
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.salt import salt_from_hex

from .daemon import hello, http_raw, http_request, json_of, status_of
from .process import DaemonProcess, raise_fd_limit

pytestmark = pytest.mark.multiproc

FLOOD_BOUND_SECS = 1.0
MAGIC_DEADLINE_SECS = 5.0  # ControllerOptions.magic_deadline default, what `flodld serve` runs with
IDLE, SLOW_HTTP, SLOW_JOIN = 400, 300, 300


async def _timed_state(port: int) -> float:
    loop = asyncio.get_running_loop()
    begun = loop.time()
    response = await http_raw(port, http_request("GET", "/state.json"), timeout=10)
    assert status_of(response) == 200
    return loop.time() - begun


async def _timed_join(port: int, token: str, host: str) -> float:
    loop = asyncio.get_running_loop()
    begun = loop.time()
    stream = await open_channel("127.0.0.1", port, Channel.JOIN, salt_from_hex(token), timeout=10)
    await stream.send(hello(host))
    reply = (await stream.recv(10)).message()
    elapsed = loop.time() - begun
    assert isinstance(reply, Accept), reply
    await stream.aclose()
    return elapsed


@asynccontextmanager
async def _flood(port: int) -> AsyncIterator[dict[str, list[asyncio.StreamWriter]]]:
    """Open the hostile connections and keep the slow ones trickling one byte every 0.5 s."""
    groups: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {
        "idle": [],
        "http": [],
        "join": [],
    }
    for name, count in (("idle", IDLE), ("http", SLOW_HTTP), ("join", SLOW_JOIN)):
        for _ in range(count):
            groups[name].append(await asyncio.open_connection("127.0.0.1", port))
    for _, writer in groups["http"]:
        writer.write(b"GET /state.json HTTP/1.1\r\nX-Slow: ")
    for _, writer in groups["join"]:
        writer.write(magic_prefix(Channel.JOIN))

    async def trickle() -> None:
        while True:
            await asyncio.sleep(0.5)
            for _, writer in groups["http"] + groups["join"]:
                if not writer.is_closing():
                    writer.write(b"a")

    task = asyncio.get_running_loop().create_task(trickle())
    try:
        yield {name: [w for _, w in pairs] for name, pairs in groups.items()}
    finally:
        task.cancel()
        for pairs in groups.values():
            for _, writer in pairs:
                writer.close()


async def _closed_by_peer(reader: asyncio.StreamReader, within: float = 0.01) -> bool:
    """True once the peer has closed (EOF or reset) within `within` s; False if it is still open then."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), max(within, 0.01)) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_a_thousand_hostile_connections_do_not_delay_state_json_or_a_join(tmp_path: Path) -> None:
    raise_fd_limit(4096)
    daemon = DaemonProcess(tmp_path)
    try:
        port = daemon.port
        baseline_fds = daemon.open_fds()
        quiet = [await _timed_state(port) for _ in range(10)]
        quiet_join = await _timed_join(port, daemon.token, "quiet")
        async with _flood(port):
            await asyncio.sleep(0.5)
            assert daemon.open_fds() >= baseline_fds + 900, "the flood did not reach the daemon"
            loud = [await _timed_state(port) for _ in range(10)]
            loud_join = await _timed_join(port, daemon.token, "during-flood")
            assert max(loud) < FLOOD_BOUND_SECS, (quiet, loud)
            assert loud_join < FLOOD_BOUND_SECS, (quiet_join, loud_join)
        print(
            f"state.json median quiet {statistics.median(quiet) * 1e3:.1f} ms, under flood "
            f"{statistics.median(loud) * 1e3:.1f} ms; join {quiet_join * 1e3:.1f} -> {loud_join * 1e3:.1f} ms"
        )
        for _ in range(100):
            if daemon.open_fds() <= baseline_fds + 5:
                break
            await asyncio.sleep(0.1)
        assert daemon.open_fds() <= baseline_fds + 5, "connections closed by the peers were not released"
        assert daemon.proc.poll() is None
    finally:
        daemon.kill()


async def test_connections_that_never_send_a_magic_are_cut_at_the_mux_deadline(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path)
    try:
        readers = []
        for _ in range(50):
            reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
            readers.append((reader, writer))
        for _, writer in readers[:25]:
            writer.write(b"\xe3")  # one byte of a magic, then silence
        # each must be closed by the deadline plus 1.5 s; the wait ends as soon as the last one is
        loop = asyncio.get_running_loop()
        bound = loop.time() + MAGIC_DEADLINE_SECS + 1.5
        closed = [await _closed_by_peer(reader, bound - loop.time()) for reader, _ in readers]
        assert all(closed), f"{closed.count(False)} of 50 pre-magic connections outlived the deadline"
        response = await http_raw(daemon.port, http_request("GET", "/state.json"))
        refused = json_of(response)["refused"]
        assert refused.get("connection_deadline") == 50
        for _, writer in readers:
            writer.close()
    finally:
        daemon.kill()


async def test_a_byte_at_a_time_http_head_is_cut_within_a_bound(tmp_path: Path) -> None:
    """A slowloris HTTP head must not hold a connection (and an fd) for ever: the daemon closes it within
    the mux deadline plus 2 s even though a byte arrives every half second.
    """
    daemon = DaemonProcess(tmp_path)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(b"GET /state.json HTTP/1.1\r\nX-Slow: ")
        loop = asyncio.get_running_loop()
        begun = loop.time()
        bound = MAGIC_DEADLINE_SECS + 2
        cut = False
        while loop.time() - begun < bound + 1:
            await asyncio.sleep(0.5)
            try:
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                cut = True
                break
            if await _closed_by_peer(reader):
                cut = True
                break
        writer.close()
        assert cut, f"a slowloris HTTP head was still open after {loop.time() - begun:.1f}s (bound {bound}s)"
    finally:
        daemon.kill()
