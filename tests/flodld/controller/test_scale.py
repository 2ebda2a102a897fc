"""Issue 18: a world larger than 4096 hosts forms, each WorldFormed is O(1) in the world's size, a world
limit is a refusal at join (never a stall), and a WorldFormed that cannot be built fails the run.

Real controller, real loopback sockets, every agent in this process.
"""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from flodld.net.stream import FramedStream, open_channel
from flodld.wire.join import Accept, RankExited, Reject, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.messages import MAX_LIST_ITEMS
from tests.flodld.controller.agents import eventually, hello, http, join, options, started

HOSTS = 5000
assert HOSTS > MAX_LIST_ITEMS  # the old envelope listed every host: capped at MAX_LIST_ITEMS


def _fds_for(hosts: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * hosts + 512  # both ends of every link live in this process
    if soft < wanted:
        if hard < wanted:
            pytest.skip(f"needs {wanted} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


async def _storm(
    port: int, key: bytes, hosts: int, in_flight: int = 256
) -> list[tuple[FramedStream, Accept]]:
    gate = asyncio.Semaphore(in_flight)

    async def one(index: int) -> tuple[FramedStream, Accept]:
        async with gate:
            stream = await open_channel("127.0.0.1", port, Channel.JOIN, key, timeout=30)
            await stream.send(hello(f"h{index:05d}"))
            reply = (await stream.recv(30)).message()
            assert isinstance(reply, Accept), reply
            return stream, reply

    return await asyncio.gather(*(one(i) for i in range(hosts)))


async def test_a_world_of_5000_hosts_forms_with_a_small_world_formed_per_host() -> None:
    _fds_for(HOSTS)
    # Handshake and magic deadlines sized for a busy 2-core CI box, not for a test of deadlines
    controller, port = await started(
        options(
            capacity=HOSTS, join=JoinConfig(join_timeout=120), handshake_timeout=30.0, magic_deadline=30.0
        )
    )
    links: list[tuple[FramedStream, Accept]] = []
    try:
        begun = time.monotonic()
        links = await _storm(port, controller.salt, HOSTS)
        assert sorted(r for _, a in links for r in a.ranks) == list(range(HOSTS))
        frames = await asyncio.gather(*(stream.recv(60) for stream, _ in links))
        formed_in = time.monotonic() - begun
        sizes = set()
        for (_, accept), frame in zip(links, frames, strict=True):
            message = frame.message()
            assert isinstance(message, WorldFormed), message
            assert message.envelope.world_size == HOSTS and message.envelope.ranks == accept.ranks
            sizes.add(len(frame.payload))
        # O(1) per host: the payloads differ only by the digits of the rank (5000 hosts: at most 4 lengths)
        assert max(sizes) < 512 and max(sizes) - min(sizes) <= 4, sizes
        await eventually(lambda: controller.phase is Phase.TRAINING, timeout=30)
        # The roster is fetched once, paged, from state.json (not shipped in every WorldFormed)
        _, body = await http(port, "GET", "/state.json")
        assert body["joined_hosts"] == HOSTS and body["members_page"] == {
            "start": 0,
            "stop": 500,
            "total": HOSTS,
        }
        assert len(body["members"]) == 500 and body["member_counts"]["by_link"] == {"open": HOSTS}
        _, tail = await http(port, "GET", f"/state.json?members={HOSTS - 3}..{HOSTS + 10}")
        by_rank = {a.ranks[0]: f"h{i:05d}" for i, (_, a) in enumerate(links)}
        assert [m["host"] for m in tail["members"]] == [by_rank[r] for r in range(HOSTS - 3, HOSTS)]
        print(
            f"{HOSTS} hosts formed {formed_in:.1f}s after the first dial; WorldFormed payload {max(sizes)} "
            "bytes"
        )
        for stream, accept in links:
            for rank in accept.ranks:
                await stream.send(RankExited(rank=rank, code=0))
        await asyncio.gather(*(stream.aclose() for stream, _ in links))
        assert (await asyncio.wait_for(controller.wait(), 60)).verdict is Phase.DONE
    finally:
        for stream, _ in links:
            stream.close()
        await controller.close()


async def test_a_host_past_the_world_limit_is_refused_at_join_with_world_full() -> None:
    controller, port = await started(options(capacity=10, join=JoinConfig(join_timeout=30)))
    try:
        assert controller.window is not None
        controller.window.ledger.max_world_ranks = 3
        first = await join(port, controller.salt, "a", devices=2)
        assert first.accepted.ranks == [0, 1]
        refused = await join(port, controller.salt, "b", devices=2)
        assert isinstance(refused.reply, Reject) and refused.reply.code == "world_full"
        assert "at most 3" in refused.reply.reason
        _, body = await http(port, "GET", "/state.json")
        assert body["refused"]["world_full"] == 1 and body["phase"] == "waiting"
    finally:
        await controller.close()


async def test_a_world_formed_that_cannot_be_built_fails_the_run_with_the_reason() -> None:
    # More run env entries than a WorldEnvelope may carry: the envelope cannot be built
    env = {f"V{i}": "x" for i in range(MAX_LIST_ITEMS + 1)}
    controller, port = await started(options(capacity=1, env=env, join=JoinConfig(join_timeout=30)))
    try:
        agent = await join(port, controller.salt, "a")
        assert agent.accepted.ranks == [0]
        result = await asyncio.wait_for(controller.wait(), 10)
        assert result.verdict is Phase.FAILED
        assert "formation failed: could not build WorldFormed" in result.reason
        await agent.abort()
    finally:
        await controller.close()
