"""The soak's simulated agents and probes, at protocol level: joins, one run's hosts, state.json.

A "kill" is what the controller sees when an agent is SIGKILLed while a run trains: the join link ends
without the host's rank reports, sent as a TCP reset (`reset`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from soak_figures import Figures

from flodld.net.stream import FramedStream, open_channel
from flodld.wire.join import JOIN_PROTOCOL_VERSION as PROTOCOL_VERSION
from flodld.wire.join import Accept, Hello, RankExited, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt, salt_from_hex, salt_to_hex

RUN_BOUND_SECS = 30.0


def hello(host: str) -> Hello:
    return Hello(
        host=host,
        devices=["cpu:0"],
        device_labels=[],
        variant="cpu",
        torch_version="2.13",
        protocol_version=PROTOCOL_VERSION,
    )


async def get_state(port: int) -> float:
    begun = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /state.json HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
    response = await reader.read(-1)
    writer.close()
    if not response.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"state.json answered {response[:60]!r}")
    return time.perf_counter() - begun


async def poll(port: int, figures: Figures, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            figures.state_latency.append(await get_state(port))
        except (OSError, RuntimeError):
            await asyncio.sleep(0.01)  # between runs the port is briefly closed
        await asyncio.sleep(0.005)


async def join(port: int, key: bytes, host: str, figures: Figures) -> FramedStream:
    begun = time.perf_counter()
    stream = await open_channel("127.0.0.1", port, Channel.JOIN, key, timeout=10)
    await stream.send(hello(host))
    reply = (await stream.recv(10)).message()
    if not isinstance(reply, Accept):
        raise RuntimeError(f"{host} was refused: {reply!r}")
    figures.join_latency.append(time.perf_counter() - begun)
    return stream


def reset(stream: FramedStream) -> None:
    """Close with a TCP reset, as the kernel does for a killed process with unread data."""
    sock = stream.writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.writer.transport.abort()


async def one_run(
    port: int, key: bytes, args: argparse.Namespace, rng: random.Random, figures: Figures, index: int
) -> str:
    """Drive one run; returns the expected verdict."""
    begun = time.perf_counter()
    leavers = [await join(port, key, f"leaver-{index}-{i}", figures) for i in range(args.leavers)]
    for stream in leavers:
        await stream.aclose()
    await asyncio.sleep(0.05)  # let the retractions land before the members fill the target
    members = await asyncio.gather(
        *(join(port, key, f"host-{index}-{i}", figures) for i in range(args.hosts))
    )
    formed = [(await stream.recv(RUN_BOUND_SECS)).message() for stream in members]
    if not all(isinstance(message, WorldFormed) for message in formed):
        raise RuntimeError(f"run {index}: expected WorldFormed everywhere, got {formed!r}")
    kill = rng.random() < args.kill_rate
    victim = rng.randrange(args.hosts) if kill else -1
    for position, (stream, message) in enumerate(zip(members, formed, strict=True)):
        assert isinstance(message, WorldFormed)
        if position == victim:
            reset(stream)
            continue
        for rank in message.envelope.ranks:
            await stream.send(RankExited(rank=rank, code=0))
        await stream.aclose()
    figures.run_latency.append(time.perf_counter() - begun)
    return "failed" if kill else "done"


def fresh_endpoint() -> tuple[int, str, bytes]:
    """A free loopback port and a new join token for one soak: (port, token hex, token)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    salt_hex = salt_to_hex(new_salt())
    return port, salt_hex, salt_from_hex(salt_hex)


async def service_state(port: int) -> dict[str, Any] | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /state.json HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
    response = await reader.read(-1)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    loaded: dict[str, Any] = json.loads(body)
    return loaded


def window_open(run_id: str, state: dict[str, Any]) -> bool:
    """The window of run `run_id` is open."""
    return bool(state.get("run_id") == run_id and state.get("phase") == "waiting")


def in_history(run_id: str, state: dict[str, Any]) -> bool:
    """Run `run_id` has ended (it is in the history)."""
    return any(entry.get("run_id") == run_id for entry in state.get("history") or [])


async def until_state(port: int, predicate: Callable[[dict[str, Any]], bool], bound: float) -> dict[str, Any]:
    deadline = time.monotonic() + bound
    while True:
        with contextlib.suppress(OSError):
            state = await service_state(port)
            if state is not None and predicate(state):
                return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"state.json never showed the expected state within {bound:g}s")
        await asyncio.sleep(0.01)
