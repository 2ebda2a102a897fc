"""Join links that break after formation, on a real daemon with protocol-level agents (fast, no torch)."""

from __future__ import annotations

import asyncio
import socket
import struct

from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from flodld.wire.join import Abort, Accept, RankExited, WorldFormed

from .daemon import RawJoin, hello, options, raw_join, running

FAIL_BOUND_SECS = 2.0


async def _member(port: int, key: bytes, host: str) -> RawJoin:
    client = await raw_join(port, key)
    client.write(client.conn.send_message(hello(host)))
    assert isinstance(await client.next_message(), Accept)
    return client


def _reset(client: RawJoin) -> None:
    sock = client.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.writer.transport.abort()


async def test_a_reset_join_link_after_formation_is_lost_and_fails_the_run_with_its_rank() -> None:
    opts = options(capacity=2, join=JoinConfig(join_timeout=30, target_ranks=2, min_rank_start=2))
    async with running(opts) as (controller, port):
        a = await _member(port, controller.salt, "a")
        b = await _member(port, controller.salt, "b")
        world_a, world_b = await a.next_message(), await b.next_message()
        assert isinstance(world_a, WorldFormed) and isinstance(world_b, WorldFormed)
        _reset(b)
        result = await asyncio.wait_for(controller.wait(), FAIL_BOUND_SECS)
        assert result.verdict is Phase.FAILED and "1" in result.reason, result.reason
        abort = await a.next_message()
        assert isinstance(abort, Abort)
        body = controller.state_json()
        assert body is not None
        assert {m["host"]: m["link"] for m in body["members"]}["b"] == "lost"
        assert body["joined_ranks"] == 2
        a.close()


async def test_a_host_that_reports_every_rank_and_closes_is_done() -> None:
    opts = options(capacity=1, join=JoinConfig(join_timeout=30, target_ranks=1, min_rank_start=1))
    async with running(opts) as (controller, port):
        a = await _member(port, controller.salt, "a")
        formed = await a.next_message()
        assert isinstance(formed, WorldFormed)
        a.write(a.conn.send_message(RankExited(rank=0, code=0)))
        a.writer.write_eof()
        result = await asyncio.wait_for(controller.wait(), FAIL_BOUND_SECS)
        assert result.verdict is Phase.DONE
        body = controller.state_json()
        assert body is not None and body["rank_exits"] == [{"rank": 0, "code": 0}]
