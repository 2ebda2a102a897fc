"""A real controller on 127.0.0.1 for abuse tests, and raw-socket clients that record every byte."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.wire.frames import CLOSED, NEED_DATA, Frame, FrameConnection, Role
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Hello
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import Message

# A refused connection must be closed by the daemon within this bound (handshake deadline + slack).
CLOSE_BOUND_SECS = 4.0


def options(**overrides: object) -> ControllerOptions:
    values: dict[str, Any] = {
        "bind_host": "127.0.0.1", "port": 0, "tick_interval": 0.02, "magic_deadline": 1.5,
        "handshake_timeout": 1.5, "run_id": "abuse-run", "capacity": 8,
        "join": JoinConfig(join_timeout=60, target_ranks=8, min_rank_start=1),
    }
    values.update(overrides)
    return ControllerOptions.model_validate(values)


@asynccontextmanager
async def running(opts: ControllerOptions | None = None) -> AsyncIterator[tuple[Controller, int]]:
    controller = Controller(opts or options())
    _, port = await controller.start()
    try:
        yield controller, port
    finally:
        await controller.close()


def hello(host: str, devices: int = 1, **changes: object) -> Hello:
    values: dict[str, Any] = {
        "host": host, "devices": [f"cpu:{i}" for i in range(devices)], "device_labels": [], "variant": "cpu",
        "torch_version": "2.13", "protocol_version": JOIN_PROTOCOL_VERSION,
    }
    values.update(changes)
    return Hello(**values)


@dataclass
class RawJoin:
    """A join dialer on a plain stream that keeps a transcript of what it sent and received."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: FrameConnection
    sent: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        self.writer.write(data)

    async def read_until_closed(self, timeout: float = CLOSE_BOUND_SECS) -> bytes:
        """Everything the daemon sends until it closes; TimeoutError if it keeps the connection open."""
        chunks = bytearray()
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                chunks += data
        self.received += chunks
        return bytes(chunks)

    async def next_message(self, timeout: float = 5.0) -> Message:
        async with asyncio.timeout(timeout):
            while True:
                event = self.conn.next_event()
                if isinstance(event, Frame):
                    return event.message()
                if event is CLOSED:
                    raise EOFError("daemon closed the join link")
                assert event is NEED_DATA
                data = await self.reader.read(max(self.conn.bytes_wanted, 1))
                self.received += data
                self.conn.receive_data(data)

    def close(self) -> None:
        self.writer.close()


async def raw_join(port: int, key: bytes, *, host: str = "127.0.0.1", source: str | None = None) -> RawJoin:
    """Dial the join channel and finish the nonce exchange, byte by byte under our control."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0) if source else None)
    conn = FrameConnection(Role.DIALER, key, channel=Channel.JOIN)
    client = RawJoin(reader, writer, conn)
    client.write(magic_prefix(Channel.JOIN) + conn.initial_bytes())
    nonce = await asyncio.wait_for(reader.readexactly(16), 5)
    client.received += nonce
    conn.receive_data(nonce)
    return client


async def http_raw(port: int, request: bytes, *, host: str = "127.0.0.1", timeout: float = 5.0) -> bytes:
    """Send raw bytes to the HTTP surface, return everything until the daemon closes."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    try:
        async with asyncio.timeout(timeout):
            return await reader.read(-1)
    finally:
        writer.close()


def http_request(method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: t", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict[str, Any]:
    """The JSON object in an HTTP response's body (every endpoint answers one)."""
    body: dict[str, Any] = json.loads(response.partition(b"\r\n\r\n")[2])
    return body


async def state(port: int, *, host: str = "127.0.0.1") -> dict[str, Any]:
    response = await http_raw(port, http_request("GET", "/state.json"), host=host)
    assert status_of(response) == 200, response[:200]
    body: dict[str, Any] = json_of(response)
    return body


STATE_SETTLE_SECS = 3.0
"""state.json is cached (rebuilt at most every 200 ms, held up to 1 s while nothing changed): a reader
that needs an event it just caused polls until it shows, within this bound."""


async def state_until(
    port: int, check: Callable[[dict[str, Any]], bool], *, host: str = "127.0.0.1"
) -> dict[str, Any]:
    """The first state.json for which `check` holds, polled for at most STATE_SETTLE_SECS.

    When none does in time, the last one.
    """
    deadline = asyncio.get_running_loop().time() + STATE_SETTLE_SECS
    while True:
        body = await state(port, host=host)
        if check(body) or asyncio.get_running_loop().time() > deadline:
            return body
        await asyncio.sleep(0.05)


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine outside 127/8 (the route's source for a public target), if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # UDP connect sends nothing; it only picks a source address
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address
