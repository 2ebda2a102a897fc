"""Rank liveness reaches the verdict.

A rank silent past the heartbeat timeout fails the run, named in state.json.
"""

from __future__ import annotations

import asyncio
import contextlib

from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.run import Controller
from flodld.membership.phase import Phase
from flodld.net.stream import FramedStream
from flodld.wire.control import Heartbeat
from flodld.wire.data import HelloAck
from flodld.wire.magic import Channel

from .agents import Agent, eventually, http, join, options
from .relays import agent_host_key, open_relay

LIVENESS_ENV = {
    "FLODL_LIVENESS_TIMEOUT_SECS": "0.4",
    "FLODL_LIVENESS_STARTUP_SECS": "0.8",
    "FLODL_HEARTBEAT_INTERVAL_SECS": "0.05",
}


async def _formed(devices: int) -> tuple[Controller, int]:
    opts = options(
        capacity=devices,
        averaging="cpu_sync",
        env=LIVENESS_ENV,
        join=JoinConfig(join_timeout=30, target_ranks=devices, min_rank_start=devices),
    )
    controller = Controller(opts)
    attach_data_plane(controller, environ={})
    _, port = await controller.start()
    return controller, port


async def _relayed_host(controller: Controller, port: int, devices: int) -> tuple[Agent, FramedStream]:
    """Host 'h' with DEVICES ranks joins, the world forms, and its relay's control channel is open."""
    agent = await join(port, controller.salt, "h", devices=devices)
    await agent.world()
    key = agent_host_key(controller.salt, "h", controller.run_id, agent.stream.conn)
    ranks = list(range(devices))
    relay, reply = await open_relay(port, controller.salt, key, Channel.CONTROL, host="h", ranks=ranks)
    assert isinstance(reply, HelloAck)
    return agent, relay


async def test_a_silent_rank_fails_the_run_and_state_json_names_the_rank_and_the_reason() -> None:
    controller, port = await _formed(devices=2)
    try:
        _agent, relay = await _relayed_host(controller, port, devices=2)  # held: its join link stays open
        # Rank 0 beats through its relay; rank 1 never says a word.

        async def beat() -> None:
            while True:
                await relay.send(Heartbeat(rank=0, step=0))
                await asyncio.sleep(0.05)

        beating = asyncio.create_task(beat())
        try:
            result = await asyncio.wait_for(controller.wait(), 10)
            _, body = await http(port, "GET", "/state.json")
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await beating
        assert result.verdict is Phase.FAILED
        assert body["phase"] == "failed"
        assert "ranks [0, 1]" in body["reason"], body["reason"]  # the silent rank's host is lost with both
        # never heard at all: declared dead once the startup grace (not the steady timeout) ran out
        assert "rank 1 on 'h' sent no heartbeat for 0.8s" in body["reason"], body["reason"]
        assert "rank 1" in result.reason and "no heartbeat" in result.reason
        assert [m["link"] for m in body["members"]] == ["lost"]
    finally:
        await controller.close()


async def test_ranks_that_keep_beating_keep_the_run_training() -> None:
    controller, port = await _formed(devices=1)
    try:
        agent, relay = await _relayed_host(controller, port, devices=1)
        for _ in range(30):  # 1.5 s: well past the 0.4 s timeout and the 0.8 s startup grace
            await relay.send(Heartbeat(rank=0, step=0))
            await asyncio.sleep(0.05)
        assert controller.phase is Phase.TRAINING
        await agent.leave()
        await eventually(lambda: controller.phase is Phase.DONE, timeout=5)
    finally:
        await controller.close()
