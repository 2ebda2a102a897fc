"""Simulated agents for controller tests: dial the join channel on loopback and speak the protocol."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.net.stream import FramedStream, open_channel
from flodld.wire.join import JOIN_PROTOCOL_VERSION as PROTOCOL_VERSION
from flodld.wire.join import Abort, Accept, Hello, RankExited, Reject, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.messages import Message
from flodld.wire.salt import salt_from_hex


def hello(host: str, devices: int = 1) -> Hello:
    return Hello(
        host=host, devices=[f"cpu:{i}" for i in range(devices)], device_labels=[], variant="cpu",
        torch_version="2.13", protocol_version=PROTOCOL_VERSION,
    )


@dataclass
class Agent:
    host: str
    stream: FramedStream
    reply: Message
    received: list[Message] = field(default_factory=list)
    world_ranks: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> Accept:
        assert isinstance(self.reply, Accept), f"{self.host} got {self.reply!r}"
        return self.reply

    async def next(self, timeout: float = 5.0) -> Message:
        message = (await self.stream.recv(timeout)).message()
        self.received.append(message)
        return message

    async def world(self, timeout: float = 5.0) -> WorldFormed:
        message = await self.next(timeout)
        assert isinstance(message, WorldFormed), f"{self.host} expected WorldFormed, got {message!r}"
        self.world_ranks = list(message.envelope.ranks)
        return message

    async def abort(self, timeout: float = 5.0) -> Abort:
        message = await self.next(timeout)
        assert isinstance(message, Abort), f"{self.host} expected Abort, got {message!r}"
        return message

    async def report_exit(self, rank: int, code: int) -> None:
        await self.stream.send(RankExited(rank=rank, code=code))

    async def leave(self) -> None:
        """What a real agent does at the end: report each rank's (clean) exit, then close the link."""
        for rank in self.world_ranks:
            await self.report_exit(rank, 0)
        await self.stream.aclose()


async def join(
    port: int,
    key: bytes,
    host: str,
    devices: int = 1,
    *,
    open_admission: bool = False,
    address: str = "127.0.0.1",
) -> Agent:
    """Dial, hello, read Accept/Reject; under open admission switch to the salt from Accept."""
    stream = await open_channel(address, port, Channel.JOIN, key, timeout=10)
    await stream.send(hello(host, devices))
    reply = (await stream.recv(10)).message()
    assert isinstance(reply, Accept | Reject), reply
    if open_admission and isinstance(reply, Accept):
        assert reply.salt_hex is not None
        stream.rekey(salt_from_hex(reply.salt_hex))
    return Agent(host, stream, reply)


def options(**overrides: object) -> ControllerOptions:
    """Loopback controller on an ephemeral port with scaled-down timeouts."""
    values: dict[str, object] = {
        "bind_host": "127.0.0.1",
        "port": 0,
        "tick_interval": 0.02,
        "magic_deadline": 2.0,
        "handshake_timeout": 2.0,
        "run_id": "test-run",
    }
    values.update(overrides)
    return ControllerOptions.model_validate(values)


async def started(opts: ControllerOptions) -> tuple[Controller, int]:
    controller = Controller(opts)
    _, port = await controller.start()
    return controller, port


async def http(
    port: int, method: str, path: str, headers: dict[str, str] | None = None, *, address: str = "127.0.0.1"
) -> tuple[int, dict]:  # type: ignore[type-arg]
    """One raw HTTP/1.1 request to ADDRESS over a fresh connection; returns (status, JSON body)."""
    reader, writer = await asyncio.open_connection(address, port)
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Connection: close", "Content-Length: 0"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


async def eventually(predicate: Callable[[], object], timeout: float = 3.0) -> None:
    """Poll `predicate` until true (the controller acts on its own loop turn)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class TurnCounter:
    """Counts event-loop turns: a callback that re-schedules itself runs once per turn."""

    def __init__(self) -> None:
        self.turn = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False


def server_transports(port: int) -> int:
    """Transports alive in this process whose local port is `port` (after a full collection)."""
    gc.collect()
    return sum(
        1 for o in gc.get_objects()
        if isinstance(o, asyncio.Transport) and o.get_extra_info("sockname", ("", 0))[1] == port
    )  # fmt: skip
