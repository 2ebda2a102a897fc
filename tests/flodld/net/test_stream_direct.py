"""`FramedStream.read_directly`: the socket read straight into the connection's buffers, same frames.

Frames sent before the switch (already in the StreamReader), large frames in the lazily mapped
buffers, a timeout that loses nothing, reading paused between receives (back-pressure), and a
clean close as EOFError.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flodld.net import FramedStream, accept_channel, open_channel
from flodld.wire.join import Abort, RankExited
from flodld.wire.magic import Channel

SALT = bytes(range(16))


@contextlib.asynccontextmanager
async def connected() -> AsyncIterator[tuple[FramedStream, FramedStream]]:
    """A DATA channel over loopback: (dialer, accepted end); both ends and the server closed after."""
    accepted: asyncio.Future[FramedStream] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)  # the channel magic, as the mux reads it
        accepted.set_result(await accept_channel(reader, writer, SALT, channel=Channel.DATA, timeout=5))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dialer = await open_channel("127.0.0.1", port, Channel.DATA, SALT, timeout=5)
    receiver = await asyncio.wait_for(accepted, 5)
    try:
        yield dialer, receiver
    finally:
        dialer.close()
        receiver.close()
        server.close()


async def test_frames_before_and_after_the_switch_arrive_intact_and_in_order() -> None:
    async with connected() as (sender, receiver):
        sizes = [10, 3 * 1024 * 1024 + 7, 0, 65_537, 5 * 1024 * 1024]
        tails = [bytes([n]) * size for n, size in enumerate(sizes)]

        async def send_all() -> None:
            for index, tail in enumerate(tails):
                await sender.send(RankExited(rank=index, code=0), tail)

        await sender.send(Abort(reason="first"))
        assert (await receiver.recv(5)).message() == Abort(reason="first")  # authenticated
        sending = asyncio.create_task(send_all())
        await asyncio.sleep(0.1)  # the StreamReader holds the start of the stream, the sender waits to drain
        assert receiver.read_directly()
        for index, tail in enumerate(tails):
            frame = await receiver.recv(10)
            assert frame.message() == RankExited(rank=index, code=0)
            assert frame.tail_view == tail, index
            receiver.conn.recycle(frame)
        await sending


async def test_reading_pauses_between_receives_and_a_timeout_loses_nothing() -> None:
    async with connected() as (sender, receiver):
        await sender.send(Abort(reason="first"))
        await receiver.recv(5)
        assert receiver.read_directly()
        transport = receiver.writer.transport
        assert isinstance(transport, asyncio.Transport)
        with pytest.raises(TimeoutError):
            await receiver.recv(0.05)
        assert not transport.is_reading()  # nobody asked: the kernel holds the bytes
        sending = asyncio.create_task(sender.send(RankExited(rank=1, code=0), b"x" * (2 * 1024 * 1024)))
        await asyncio.sleep(0.1)
        assert not transport.is_reading()
        frame = await receiver.recv(5)
        assert frame.message() == RankExited(rank=1, code=0) and frame.tail == b"x" * (2 * 1024 * 1024)
        await sending
        await sender.aclose()
        with pytest.raises(EOFError):
            await receiver.recv(5)


async def test_a_large_body_wakes_the_reader_once_however_many_reads_it_takes() -> None:
    """Inside a frame's body the socket is read straight into it, read after read, and the reader is woken
    once, when the body is complete (not after every read); reading then pauses until the next `recv`.
    """
    async with connected() as (sender, receiver):
        await sender.send(Abort(reason="first"))
        await receiver.recv(5)
        assert receiver.read_directly()
        direct = receiver._direct
        assert direct is not None
        transport = receiver.writer.transport
        assert isinstance(transport, asyncio.Transport)
        reads = wakes = 0
        updated, wake = direct.buffer_updated, direct._wake

        def counting_update(nbytes: int) -> None:
            nonlocal reads
            reads += 1
            updated(nbytes)

        def counting_wake() -> None:
            nonlocal wakes
            wakes += 1
            wake()

        direct.buffer_updated = counting_update  # type: ignore[method-assign]
        direct._wake = counting_wake  # type: ignore[method-assign]
        sock = receiver.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a small window: many reads
        tail = bytes(range(256)) * (24 * 1024)  # 6 MiB
        sending = asyncio.create_task(sender.send(RankExited(rank=3, code=0), tail))
        frame = await receiver.recv(10)
        assert frame.message() == RankExited(rank=3, code=0) and frame.tail_view == tail
        await sending
        assert reads > 3, reads  # the body came in several reads (the header in its own)
        assert wakes <= 2, (wakes, reads)  # the header's read, the body's end
        assert not transport.is_reading()
        sending = asyncio.create_task(sender.send(RankExited(rank=4, code=0), b"y" * 70_000))
        frame = await receiver.recv(5)
        assert frame.message() == RankExited(rank=4, code=0) and frame.tail == b"y" * 70_000
        await sending


async def test_large_frames_are_built_in_spare_buffers_the_transport_no_longer_reads() -> None:
    """A sender reuses two spare buffers for its large frames, the next built while the transport may still
    hold the end of the last (not in a fresh map each time it does), and every frame arrives intact.
    """
    async with connected() as (sender, receiver):
        transport = sender.writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.set_write_buffer_limits(high=64 * 1024 * 1024)  # drain returns with bytes still queued
        await sender.send(Abort(reason="first"))
        await receiver.recv(5)
        assert receiver.read_directly()
        built_in_spare_while_queued = 0
        seal = sender.conn.send_frame

        def spying(kind: int, payload: bytes, tail: Any = b"", *, buffer: bytearray | None = None) -> Any:  # noqa: ANN401
            nonlocal built_in_spare_while_queued
            if buffer is not None and transport.get_write_buffer_size():
                built_in_spare_while_queued += 1
            return seal(kind, payload, tail, buffer=buffer)

        sender.conn.send_frame = spying  # type: ignore[method-assign]
        tails = [bytes([index]) * (3 * 1024 * 1024) for index in range(10)]

        async def send_all() -> None:
            for index, tail in enumerate(tails):
                await sender.send(RankExited(rank=index, code=0), tail)

        sending = asyncio.create_task(send_all())
        for index, tail in enumerate(tails):
            frame = await receiver.recv(10)
            assert frame.message() == RankExited(rank=index, code=0)
            assert frame.tail_view == tail, index
            receiver.conn.recycle(frame)
            await asyncio.sleep(0.005)  # a slower reader: the sender's transport keeps bytes queued
        await sending
        assert built_in_spare_while_queued > 0
        assert len(sender._spares) == 2


async def test_a_stream_takes_a_frame_at_once_only_with_nothing_in_flight_within_its_high_water() -> None:
    """`takes_at_once`: what a fan-out sends in turn, with no task, because that send cannot wait."""
    async with connected() as (sender, receiver):
        await sender.send(Abort(reason="first"))
        await receiver.recv(5)  # authenticated: the receiver's normal caps apply
        transport = sender.writer.transport
        assert isinstance(transport, asyncio.Transport)
        high = transport.get_write_buffer_limits()[1]
        assert sender.takes_at_once(1024) and sender.takes_at_once(high)
        assert not sender.takes_at_once(high + 1)
        async with sender._send_lock:  # a send in flight
            assert not sender.takes_at_once(1024)
        receiving = receiver.writer.transport
        assert isinstance(receiving, asyncio.Transport)
        receiving.pause_reading()  # the receiver reads nothing: the sender's bytes pile up
        sending = asyncio.create_task(sender.send(Abort(reason="big"), b"z" * (32 * 1024 * 1024)))
        await asyncio.sleep(0.1)
        assert transport.get_write_buffer_size() and not sender.takes_at_once(1024)
        receiving.resume_reading()
        assert (await receiver.recv(5)).message() == Abort(reason="big")
        await sending
