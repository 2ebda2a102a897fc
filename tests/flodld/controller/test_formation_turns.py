"""Issue 18: formation never holds the event loop for the whole world.

`WorldFormed` goes out a chunk of hosts per event-loop turn (`SHIP_CHUNK_HOSTS`), every host's in admission
order, and while formation waits for a slow host's write the run is in `forming` and state.json answers.
Turns are counted with a callback that re-schedules itself (one run per turn): no timing.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from flodld.config.join import JoinConfig
from flodld.controller import shipper
from flodld.controller.join import JoinProtocol
from flodld.membership.phase import Phase
from flodld.wire.join import WorldFormed
from flodld.wire.messages import Message
from tests.flodld.controller.agents import Agent, TurnCounter, eventually, http, join, options, started

HOSTS = 11
CHUNK = 3


async def _join_in_order(port: int, key: bytes, count: int) -> list[Agent]:
    return [await join(port, key, f"h{index:02d}") for index in range(count)]


async def test_world_formed_goes_to_every_host_in_admission_order_a_chunk_per_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shipper, "SHIP_CHUNK_HOSTS", CHUNK)
    sent: list[tuple[int, list[int]]] = []  # (turn, the envelope's ranks) per WorldFormed queued
    turns: list[TurnCounter] = []
    plain_send = JoinProtocol.send_nowait

    def recording_send(self: JoinProtocol, msg: Message) -> None:
        if isinstance(msg, WorldFormed):
            if not turns:
                turns.append(TurnCounter())
            sent.append((turns[0].turn, list(msg.envelope.ranks)))
        plain_send(self, msg)

    monkeypatch.setattr(JoinProtocol, "send_nowait", recording_send)
    controller, port = await started(options(capacity=HOSTS, join=JoinConfig(join_timeout=30)))
    try:
        agents = await _join_in_order(port, controller.salt, HOSTS)
        worlds = [await agent.world() for agent in agents]
        assert [w.envelope.ranks for w in worlds] == [[index] for index in range(HOSTS)]
        # Queued in admission order, every host once
        assert [ranks for _, ranks in sent] == [[index] for index in range(HOSTS)]
        per_turn = Counter(turn for turn, _ in sent)
        # A chunk per turn, the loop free in between: ceil(11 / 3) = 4 turns of at most 3 hosts each
        assert max(per_turn.values()) <= CHUNK
        assert len(per_turn) == -(-HOSTS // CHUNK)
        await eventually(lambda: controller.phase is Phase.TRAINING)
    finally:
        if turns:
            turns[0].stop()
        await controller.close()


async def test_state_json_answers_while_formation_waits_for_a_slow_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_host = "h02"
    released = asyncio.Event()
    drains: list[str] = []
    monkeypatch.setattr(shipper, "SHIP_CHUNK_HOSTS", CHUNK)
    # One host's WorldFormed stays in its transport until the test lets it go (a host that reads slowly)
    monkeypatch.setattr(shipper, "_write_buffered", lambda link: link.host == slow_host)
    controller, port = await started(options(capacity=5, join=JoinConfig(join_timeout=30)))
    try:
        agents = await _join_in_order(port, controller.salt, 4)
        link = controller.links[slow_host]
        plain_drain = JoinProtocol.drain

        async def held_drain(self: JoinProtocol) -> None:
            if self is link.stream:
                drains.append(link.host)
                await released.wait()
            await plain_drain(self)

        monkeypatch.setattr(JoinProtocol, "drain", held_drain)
        agents.append(await join(port, controller.salt, "h04"))
        worlds = [await agent.world() for agent in agents]  # every WorldFormed is out
        assert [w.envelope.ranks for w in worlds] == [[index] for index in range(5)]
        await eventually(lambda: drains == [slow_host])
        # Formation is waiting for the slow host: the run is forming, and the HTTP side answers meanwhile
        status, body = await http(port, "GET", "/state.json")
        assert status == 200 and body["phase"] == "forming"
        assert controller.phase is Phase.FORMING
        released.set()
        await eventually(lambda: controller.phase is Phase.TRAINING)
    finally:
        released.set()
        await controller.close()
