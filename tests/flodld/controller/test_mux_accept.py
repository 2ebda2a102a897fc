"""The mux empties the kernel's accept queue each turn, whatever the loop's own accept does.

uvloop accepts one connection per event-loop turn: in a join storm a state.json poll then waited behind
every queued dial, one turn each, before the controller saw it. Counted in loop turns (deterministic),
not in time.
"""

from __future__ import annotations

import asyncio
import socket
import time

import uvloop

from flodld.controller.metrics import ControllerCounters
from flodld.controller.mux import PortMux

QUEUED = 300


async def _turns_to_route_a_queued_burst() -> tuple[int, int]:
    mux = PortMux(ControllerCounters())  # no HTTP service: each "GET " is routed, then dropped and counted
    _, port = await mux.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    turns = 0

    def tick() -> None:
        nonlocal turns
        turns += 1
        loop.call_soon(tick)

    dialers: list[socket.socket] = []
    try:
        for _ in range(QUEUED):  # queued in the kernel while this turn runs: nobody accepts meanwhile
            dialer = socket.create_connection(("127.0.0.1", port))
            dialer.sendall(b"GET ")
            dialers.append(dialer)
        loop.call_soon(tick)
        deadline = time.monotonic() + 60
        while mux.counters.dropped["no_handler"] < QUEUED and time.monotonic() < deadline:
            await asyncio.sleep(0)
        return mux.counters.dropped["no_handler"], turns
    finally:
        for dialer in dialers:
            dialer.close()
        await mux.close()


def test_a_queued_burst_of_connections_is_routed_in_a_few_turns_not_one_turn_each() -> None:
    routed, turns = uvloop.run(_turns_to_route_a_queued_burst())
    assert routed == QUEUED
    assert turns < QUEUED // 5, f"{QUEUED} queued connections took {turns} loop turns to route"


def test_the_drain_is_gone_with_the_listener() -> None:
    async def main() -> None:
        mux = PortMux(ControllerCounters())
        _, port = await mux.start("127.0.0.1", 0)
        assert mux._drains
        mux.stop_listening()
        assert not mux._drains
        await asyncio.sleep(0)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            pass
        else:
            raise AssertionError("the port still accepts after stop_listening")
        await mux.close()

    uvloop.run(main())
