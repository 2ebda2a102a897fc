"""The per-address pre-admission gate on a real daemon: one address's flood does not lock out another."""

from __future__ import annotations

import asyncio

from .daemon import CLOSE_BOUND_SECS, hello, options, raw_join, running, state

LIMIT = 16


async def _join_from(port: int, key: bytes, host: str, source: str) -> float:
    loop = asyncio.get_running_loop()
    begun = loop.time()
    client = await raw_join(port, key, source=source)
    client.write(client.conn.send_message(hello(host)))
    await client.next_message()
    client.close()
    return loop.time() - begun


async def test_the_gate_drops_one_address_beyond_its_limit_and_releases_slots_as_connections_end() -> None:
    async with running(options(limit_loopback=True, max_pending_per_peer=LIMIT, magic_deadline=30.0)) as (
        controller, port,
    ):
        flood = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.9", 0)) for _ in range(40)
        ]
        dropped = 0
        for reader, _ in flood:
            try:
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    dropped += 1
            except TimeoutError:
                pass
            except ConnectionError:
                dropped += 1
        assert dropped == 40 - LIMIT
        assert (await state(port))["refused"].get("connection_flood") == 40 - LIMIT
        took = await _join_from(port, controller.salt, "neighbour", "127.0.0.2")
        assert took < CLOSE_BOUND_SECS
        for _, writer in flood:
            writer.close()
        await asyncio.sleep(0.2)
        assert controller.mux.gate.pending("127.0.0.9") == 0
        assert await _join_from(port, controller.salt, "flooder-now-honest", "127.0.0.9") < CLOSE_BOUND_SECS
