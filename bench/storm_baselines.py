"""The join storm's baselines: what the same number of connections and round trips cost on a bare
asyncio echo server (client and server in one process, or the server in a process of its own:
`echo_main`, run by bench/join_storm.py `--echo-server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                writer.write(await reader.readexactly(24))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
    return server, server.sockets[0].getsockname()[1]


async def baseline_connects(count: int, in_flight: int, port: int | None = None) -> float:
    """Connections/s for connect + one 24-byte echo round trip on a bare asyncio server: in this process,
    or the one listening on `port` (`echo_main`, a process of its own as the controller is).
    """
    server: asyncio.Server | None = None
    if port is None:
        server, port = await echo_server()
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"x" * 24)
            await reader.readexactly(24)
            writer.close()

    begun = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - begun
    if server is not None:
        server.close()
    return count / elapsed


async def echo_main() -> None:
    """Child process: the connect+echo baseline's server, in a process of its own (as the controller is),
    until stdin closes; prints its port first.
    """
    server, port = await echo_server()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


async def baseline_round_trips(clients: int, per_client: int) -> float:
    """Round trips/s: `clients` connections each doing `per_client` 24-byte echoes, all at once."""
    server, port = await echo_server()
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(per_client):
            writer.write(b"y" * 24)
            await reader.readexactly(24)

    begun = time.perf_counter()
    await asyncio.gather(*(one(r, w) for r, w in connections))
    elapsed = time.perf_counter() - begun
    for _, writer in connections:
        writer.close()
    server.close()
    return clients * per_client / elapsed
