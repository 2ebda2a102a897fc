"""Issue 13 point 5, in process: what a peer without the salt can make the mux hold.

- the per-address gate slot is held until the connection's FIRST AUTHENTICATED frame (not released at
  routing);
- the first frame is capped small, with no tail, before a byte of its body is read;
- every byte before authentication counts against a per-connection allowance and one global budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from flodld.controller.mux import PortMux, PreAdmissionGate
from flodld.controller.status.metrics import ControllerCounters
from flodld.net.preauth import PREAUTH_CONNECTION_BYTES, PreAuthBudget
from flodld.net.stream import FramedStream, accept_channel, open_channel
from flodld.wire.errors import WireError
from flodld.wire.frames import (
    FRAME_MAGIC,
    HEADER,
    NONCE_BYTES,
    PREAUTH_MAX_PAYLOAD,
    PROTOCOL_VERSION,
    FrameConnection,
    Role,
)
from flodld.wire.join import Abort
from flodld.wire.magic import Channel, magic_prefix

SALT = bytes(range(16))
WRONG = bytes(range(16, 32))
SOURCE = "127.0.0.9"  # a loopback alias, with the loopback exemption turned off: stands for a remote peer


@asynccontextmanager
async def serving(
    *, limit: int = 4, budget: int = 1 << 20
) -> AsyncIterator[tuple[PortMux, int, list[object]]]:
    """A mux whose stream channels run accept_channel and then echo every frame."""
    seen: list[object] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            stream = await accept_channel(reader, writer, SALT, timeout=10)
            while True:
                frame = await stream.recv(10)
                await stream.send_frame(frame.kind, frame.payload, frame.tail)
        except (EOFError, WireError, OSError, TimeoutError) as error:
            seen.append(error)

    mux = PortMux(
        ControllerCounters(),
        gate=PreAdmissionGate(limit, exempt_loopback=False),
        budget=PreAuthBudget(budget),
        magic_deadline=10.0,
    )
    for channel in (Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL):
        mux.register(channel, echo)
    _, port = await mux.start("127.0.0.1", 0)
    try:
        yield mux, port, seen
    finally:
        await mux.close()


async def _dial(port: int, channel: Channel, key: bytes = SALT) -> FramedStream:
    """Dial from SOURCE; the nonce exchange completes, nothing is authenticated yet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SOURCE, 0))
    conn = FrameConnection(Role.DIALER, key, channel=channel)
    writer.write(magic_prefix(channel) + conn.initial_bytes())
    conn.receive_data(await asyncio.wait_for(reader.readexactly(NONCE_BYTES), 5))
    return FramedStream(reader, writer, conn)


async def _is_closed(stream: FramedStream, within: float = 3.0) -> bool:
    try:
        return await asyncio.wait_for(stream.reader.read(1 << 16), within) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _eventually(predicate: Callable[[], object], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("channel", [Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL])
async def test_the_gate_slot_is_held_until_the_first_authenticated_frame(channel: Channel) -> None:
    async with serving(limit=2) as (mux, port, _):
        first, second = await _dial(port, channel), await _dial(port, channel)
        assert mux.gate.pending(SOURCE) == 2  # routed, handshaken, not yet authenticated: still counted
        reader, _writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SOURCE, 0))
        assert await asyncio.wait_for(reader.read(1), 3) == b""  # over the limit: dropped at once
        assert mux.counters.dropped["flood"] == 1
        await first.send(Abort(reason="proves the key"))
        assert (await first.recv(5)).message() == Abort(reason="proves the key")
        await _eventually(lambda: mux.gate.pending(SOURCE) == 1)  # the authenticated one gave its slot back
        third_stream = await _dial(port, channel)
        assert mux.gate.pending(SOURCE) == 2
        for stream in (first, second, third_stream):
            stream.close()
        await _eventually(lambda: mux.gate.pending(SOURCE) == 0)
        assert mux.budget.used == 0


@pytest.mark.parametrize("channel", [Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL])
async def test_a_wrong_key_never_releases_the_slot_early(channel: Channel) -> None:
    async with serving(limit=1) as (mux, port, _):
        stream = await _dial(port, channel, key=WRONG)
        await stream.send(Abort(reason="not the salt"))
        assert await _is_closed(stream)
        await _eventually(lambda: mux.gate.pending(SOURCE) == 0 and mux.budget.used == 0)


@pytest.mark.parametrize("channel", [Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL])
@pytest.mark.parametrize(
    ("payload", "tail"), [(16 * 1024 * 1024, 0), (0, 2**30), (PREAUTH_MAX_PAYLOAD + 1, 0), (10, 1)]
)
async def test_a_first_frame_over_the_small_caps_is_refused_from_its_header(
    channel: Channel, payload: int, tail: int
) -> None:
    async with serving() as (mux, port, seen):
        stream = await _dial(port, channel, key=WRONG)
        stream.writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 1, 0, payload, tail))
        assert await _is_closed(stream)
        await _eventually(lambda: any(getattr(error, "code", None) == "too_large" for error in seen))
        await _eventually(lambda: mux.budget.used == 0)


@pytest.mark.parametrize("channel", [Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL])
async def test_bytes_past_the_allowance_before_authentication_end_the_connection(channel: Channel) -> None:
    async with serving() as (mux, port, _):
        stream = await _dial(port, channel, key=WRONG)
        # A header the caps allow, then far more than its body: the excess is never buffered.
        stream.writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 1, 0, PREAUTH_MAX_PAYLOAD, 0))
        try:
            for _ in range(64):
                stream.writer.write(b"x" * 65536)
                await stream.writer.drain()
        except ConnectionError:
            pass
        assert await _is_closed(
            stream
        )  # by the allowance or by the first frame's bad tag, whichever is first
        await _eventually(lambda: mux.budget.used == 0)


async def test_one_segment_far_over_the_allowance_is_dropped_as_an_overrun() -> None:
    async with serving() as (mux, port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SOURCE, 0))
        writer.write(magic_prefix(Channel.RENDEZVOUS) + b"\x00" * (PREAUTH_CONNECTION_BYTES * 4))
        try:
            await asyncio.wait_for(reader.read(1 << 16), 3)
        except ConnectionError:
            pass
        await _eventually(lambda: mux.counters.dropped["preauth_overrun"] == 1)
        await _eventually(lambda: mux.budget.used == 0 and mux.gate.pending(SOURCE) == 0)


async def test_the_global_budget_bounds_every_unauthenticated_connection_together() -> None:
    budget = 3 * PREAUTH_CONNECTION_BYTES
    async with serving(limit=100, budget=budget) as (mux, port, _):
        streams = [await _dial(port, Channel.DATA, key=WRONG) for _ in range(8)]
        for stream in streams:  # each within its own allowance, all together past the budget
            stream.writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 1, 0, PREAUTH_MAX_PAYLOAD, 0))
            stream.writer.write(b"y" * (PREAUTH_MAX_PAYLOAD // 2))
        await _eventually(lambda: mux.counters.dropped["preauth_budget"] >= 1)
        assert mux.budget.used <= budget
        for stream in streams:
            stream.close()
        await _eventually(lambda: mux.budget.used == 0)
        # A legitimate peer is served once the budget is free again.
        legit = await open_channel("127.0.0.1", port, Channel.DATA, SALT, timeout=5)
        await legit.send(Abort(reason="hi"))
        assert (await legit.recv(5)).message() == Abort(reason="hi")
        await legit.aclose()
