"""The mux empties the kernel's accept queue each turn, whatever the loop's own accept does.

uvloop accepts one connection per event-loop turn: in a join storm a state.json poll then waited behind
every queued dial, one turn each, before the controller saw it. Counted in loop turns (deterministic),
not in time.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import uvloop

from flodld.controller.accept import ACCEPT_PER_READY, ADOPT_PER_TURN
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.wire.magic import Channel, magic_prefix

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


DIALS = 300
POLL = b"GET /state.json HTTP/1.1\r\n\r\n"


class _Recorded(asyncio.Protocol):
    def __init__(self, order: list[str], name: str) -> None:
        order.append(name)


async def _order_of_a_storm_and_a_poll(dials: int = DIALS) -> tuple[list[str], list[int]]:
    """`dials` join dials queued in the kernel, then one HTTP request: the order the mux routed them in, and
    how many connections waited for adoption at each loop turn.
    """
    order: list[str] = []
    mux = PortMux(ControllerCounters())
    mux.register_protocol(Channel.JOIN, lambda _mux, _peer: _Recorded(order, "join"))
    mux.set_http(lambda: _Recorded(order, "http"))
    _, port = await mux.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    waiting: list[int] = []

    def tick() -> None:
        waiting.append(sum(drain.waiting for drain in mux._drains))
        loop.call_soon(tick)

    dialers: list[socket.socket] = []
    try:
        for _ in range(dials):  # queued in the kernel while this turn runs: nobody accepts meanwhile
            dialer = socket.create_connection(("127.0.0.1", port))
            dialer.sendall(magic_prefix(Channel.JOIN))
            dialers.append(dialer)
        poll = socket.create_connection(("127.0.0.1", port))
        poll.sendall(POLL)
        dialers.append(poll)
        loop.call_soon(tick)
        deadline = time.monotonic() + 60
        while len(order) < dials + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0)
        return order, waiting
    finally:
        for dialer in dialers:
            dialer.close()
        await mux.close()


def test_a_request_queued_behind_a_storm_of_join_dials_is_routed_before_them() -> None:
    dials = ACCEPT_PER_READY - 8  # all accepted in one readiness, the request last
    order, _ = uvloop.run(_order_of_a_storm_and_a_poll(dials))
    assert sorted(order) == ["http"] + ["join"] * dials
    # Accepted last, handed to the loop at once, before any of the dials (the server's own accept may take
    # a dial or two before the drain runs).
    assert order.index("http") <= 2, f"routed after {order.index('http')} join dials"


def test_a_request_behind_more_dials_than_one_readiness_takes_is_routed_before_those_still_waiting() -> None:
    """It waits for the kernel's queue ahead of it to be accepted (`ACCEPT_PER_READY` a turn), then goes
    before every dial still waiting to be handed to the loop.
    """
    order, _ = uvloop.run(_order_of_a_storm_and_a_poll(DIALS))
    assert sorted(order) == ["http"] + ["join"] * DIALS
    waiting_when_accepted = DIALS - order.index("http")
    assert waiting_when_accepted >= DIALS - 2 * ACCEPT_PER_READY, f"routed after {order.index('http')} dials"


def test_the_drain_hands_a_bounded_number_of_connections_to_the_loop_per_turn() -> None:
    _, waiting = uvloop.run(_order_of_a_storm_and_a_poll())
    assert max(waiting) > ADOPT_PER_TURN, "the burst never waited for adoption: the test proves nothing"
    assert waiting[-1] == 0
    steps = [before - after for before, after in itertools.pairwise(waiting)]
    assert max(steps) <= ADOPT_PER_TURN, f"{max(steps)} connections handed over in one turn"


async def _one_readiness(dials: int, polls: int) -> tuple[int, int, int, int]:
    """`dials` join dials and then `polls` HTTP requests queued in the kernel, one readiness of the drain
    run by hand: (join dials waiting, requests waiting, requests handed to the loop at once, accepted).
    """
    mux = PortMux(ControllerCounters())
    mux.register_protocol(Channel.JOIN, lambda _mux, _peer: _Recorded([], "join"))
    mux.set_http(lambda: _Recorded([], "http"))
    _, port = await mux.start("127.0.0.1", 0)
    sockets: list[socket.socket] = []
    try:
        for index in range(dials + polls):  # queued while this turn runs: nobody accepts meanwhile
            dialer = socket.create_connection(("127.0.0.1", port))
            dialer.sendall(magic_prefix(Channel.JOIN) if index < dials else POLL)
            sockets.append(dialer)
        # Blocks the loop on purpose: nobody accepts while the bytes reach the accepted sockets' queues,
        # so they are there when the drain peeks.
        time.sleep(0.05)  # noqa: ASYNC251
        (drain,) = mux._drains
        drain._ready()
        handed = len(mux._tasks)
        return len(drain._later), len(drain._first), handed, len(drain._later) + len(drain._first) + handed
    finally:
        for dialer in sockets:
            dialer.close()
        await mux.close()


def test_a_request_accepted_behind_waiting_join_dials_is_handed_to_the_loop_in_the_same_turn() -> None:
    """Not the next turn's share: a state.json poll in a storm is one long turn sooner in the controller."""
    dials_waiting, requests_waiting, handed, accepted = uvloop.run(_one_readiness(20, 3))
    assert accepted == 23
    assert (dials_waiting, requests_waiting, handed) == (20, 0, 3)


def test_one_readiness_accepts_a_bounded_number_of_connections() -> None:
    """A storm's first burst is taken over several turns, not 1,024 accepts in one (a 40-80 ms stall that
    every state.json poll in flight waited behind).
    """
    dials_waiting, _, _, accepted = uvloop.run(_one_readiness(ACCEPT_PER_READY + 60, 0))
    assert accepted == dials_waiting == ACCEPT_PER_READY
