"""A tiny real server on 127.0.0.1 that reads the channel magic the way the controller's mux does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from flodld.net import FramedStream, accept_channel, read_channel_prefix
from flodld.wire.magic import Channel

SALT = bytes(range(16))

Handler = Callable[[FramedStream], Awaitable[None]]


@asynccontextmanager
async def loopback_server(
    on_connect: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    """Asyncio's server for ON_CONNECT on 127.0.0.1 at a free port; yields the port, closes it after."""
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def framed_server(
    handler: Handler, key: bytes = SALT, **caps: int
) -> AsyncIterator[tuple[int, list[object]]]:
    """Serve `handler` for rendezvous-channel dials; yields (port, problems seen by the server)."""
    problems: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            channel, prefix = await read_channel_prefix(reader, timeout=5)
            if channel is not Channel.RENDEZVOUS:
                problems.append(("unexpected channel", channel, prefix))
                return
            stream = await accept_channel(reader, writer, key, channel=channel, timeout=5, **caps)
            await handler(stream)
        except Exception as error:
            problems.append(error)
        finally:
            writer.close()

    async with loopback_server(on_connect) as port:
        yield port, problems


async def echo(stream: FramedStream) -> None:
    """Echo every frame back (kind, payload, tail) until the peer closes."""
    while True:
        try:
            frame = await stream.recv(timeout=5)
        except EOFError:
            return
        await stream.send_frame(frame.kind, frame.payload, frame.tail)
