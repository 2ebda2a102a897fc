"""A world of one host: its relay broadcasts its own fold (real relay, real controller data plane).

The controller's DATA HelloAck says `sole_host`; the relay then finishes each complete chunk itself and
fans it out to its ranks, so the round never crosses the controller (two encrypted hops and a process
fewer). Checked here:
- the result equals the multi-hop road's arithmetic bit for bit (relay partial in rank order, the
  controller's fold of that one partial, then finish), chunked and unchunked, round after round;
- an observer on the relay's DATA upstream sees no tensor bytes at all, and the controller folds nothing;
- liveness keeps working: a rank that leaves is folded out and the controller learns it (RankGone); a
  rank the controller declares dead is folded out too; a round that cannot finish (a mean of total
  weight zero) gives every rank the DataPlaneError;
- a multi-host world's relays are not told `sole_host`, and the controller refuses a host frame from a
  sole host.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.fold.base import Bundle
from flodld.net.stream import FramedStream, open_channel
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.control import Heartbeat
from flodld.wire.data import DataPlaneError, HelloAck, HostFrame, RankHello, RelayHello
from flodld.wire.hostkey import relay_proof
from flodld.wire.magic import Channel
from tests.flodld.relay.recorder import RecordingForwarder
from tests.flodld.relay.test_relay_chunked import (
    assert_bitwise_equal,
    chunked,
    deposit,
    receive_round,
    tree_mean,
)

SALT = bytes(range(16))
HOST = "only-host"
HOST_KEY = bytes(range(32, 48))
RANKS = [0, 1, 2]


@dataclass
class World:
    plane: DataPlane
    relay: Relay
    relay_task: asyncio.Task[int]
    relay_port: int
    upstream: RecordingForwarder
    dead: list[tuple[int, str]]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    dead: list[tuple[int, str]] = []
    plane = DataPlane(
        SALT,
        {HOST: RANKS},
        host_key={HOST: HOST_KEY}.get,
        liveness_timeout=3.0,
        heartbeat_interval=0.2,
        on_rank_dead=lambda rank, why: dead.append((rank, why)),
    )
    mux = PortMux(ControllerCounters())
    mux.register(Channel.DATA, plane.handle_data)
    mux.register(Channel.CONTROL, plane.handle_control)
    _, port = await mux.start("127.0.0.1", 0)
    plane.start()
    upstream = RecordingForwarder(port)
    listener = socket.create_server(("127.0.0.1", 0))
    relay_port = listener.getsockname()[1]
    spec = RelayRoleSpec(
        host=HOST,
        controller_host="127.0.0.1",
        controller_port=upstream.port,
        salt_hex=SALT.hex(),
        host_key_hex=HOST_KEY.hex(),
        ranks=RANKS,
        listen_fd=listener.detach(),
    )
    relay = Relay(spec)
    task = asyncio.create_task(relay.run())
    try:
        yield World(plane, relay, task, relay_port, upstream, dead)
    finally:
        relay.stop("test over", 0)
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()
        await mux.close()
        upstream.listener.close()


async def leg(world: World, channel: Channel, rank: int) -> FramedStream:
    stream = await open_channel("127.0.0.1", world.relay_port, channel, SALT, timeout=5)
    await stream.send(RankHello(rank=rank))
    assert isinstance((await stream.recv(5)).message(), HelloAck)
    return stream


async def one_round(
    legs: dict[int, FramedStream], round_number: int, chunk_bytes: int
) -> tuple[dict[int, Bundle], list[tuple[int, Bundle]]]:
    deposits = {rank: deposit(rank, round_number) for rank in legs}

    async def one(rank: int, stream: FramedStream) -> tuple[int, Bundle]:
        messages, tails = chunked(deposits[rank], chunk_bytes)
        for message, tail in zip(messages, tails, strict=True):
            await stream.send(message.model_copy(update={"round": round_number}), tail)
        return await receive_round(stream, round_number)

    return deposits, list(await asyncio.gather(*(one(rank, stream) for rank, stream in legs.items())))


@pytest.mark.parametrize("chunk_bytes", [100_003, 1 << 24], ids=["chunked", "unchunked"])
async def test_a_sole_host_broadcasts_the_multi_hop_roads_result_and_the_controller_sees_no_data(
    world: World, chunk_bytes: int
) -> None:
    legs = {rank: await leg(world, Channel.DATA, rank) for rank in RANKS}
    for round_number in range(3):
        deposits, results = await one_round(legs, round_number, chunk_bytes)
        want = tree_mean({HOST: RANKS}, deposits)  # the relay's partial, the controller's fold of it, finish
        for chunks, got in results:
            assert chunks == len(chunked(deposits[0], chunk_bytes)[0])
            assert_bitwise_equal(got, want)
    assert world.relay.deposits.sole_host and world.relay.down.rounds == 3
    # The controller folded nothing, and nothing of the tensors crossed the relay's upstreams: each
    # direction of each connection carried at most its handshake and a few small frames.
    assert world.plane.stats().rounds == 0 and world.plane._barrier is None
    one_deposit = sum(tensor.numel() * tensor.element_size() for tensor in deposits[0])
    transcripts = world.upstream.recorded()
    assert len(transcripts) == 4  # DATA and CONTROL, both directions
    assert max(len(transcript) for transcript in transcripts) < min(4096, one_deposit // 50)


async def test_a_leaving_rank_is_folded_out_and_the_controller_learns_it(world: World) -> None:
    legs = {rank: await leg(world, Channel.DATA, rank) for rank in RANKS}
    messages, tails = chunked(deposit(2, 0), 100_003)
    await legs[2].send(messages[0], tails[0])  # rank 2 leaves in the middle of its deposit
    await legs.pop(2).aclose()
    deposits = {rank: deposit(rank, 0) for rank in legs}
    for rank, stream in legs.items():
        messages, tails = chunked(deposits[rank], 100_003)
        for message, tail in zip(messages, tails, strict=True):
            await stream.send(message, tail)
    for stream in legs.values():
        _, got = await receive_round(stream, 0)
        # Chunk 0 holds rank 2's share, the rest only ranks 0 and 1: check the part rank 2 never sent.
        want = tree_mean({HOST: [0, 1]}, deposits)
        assert torch.equal(got[2], want[2])
    for _ in range(100):
        if 2 in world.plane.stats().gone_ranks:
            break
        await asyncio.sleep(0.05)
    assert world.plane.stats().gone_ranks == [2]


async def test_a_rank_the_controller_declares_dead_is_folded_out(world: World) -> None:
    controls = {rank: await leg(world, Channel.CONTROL, rank) for rank in (0, 1)}
    datas = {rank: await leg(world, Channel.DATA, rank) for rank in RANKS}

    async def beat(rank: int, stream: FramedStream) -> None:
        while True:
            await stream.send(Heartbeat(rank=rank, step=0))
            await asyncio.sleep(0.2)

    beaters = [asyncio.create_task(beat(rank, stream)) for rank, stream in controls.items()]
    try:
        for _ in range(100):
            if world.dead:
                break
            await asyncio.sleep(0.1)
        assert [rank for rank, _ in world.dead] == [2]
        values = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 6.0])}
        for rank, value in values.items():
            specs, parts = chunked((value,), 1 << 20)
            await datas[rank].send(specs[0], parts[0])
        for rank in values:
            frame = await datas[rank].recv(10)
            message = frame.message()
            assert message.contributors == [0, 1]  # type: ignore[attr-defined]
            assert bytes(frame.tail_view) == torch.tensor([2.0, 4.0]).numpy().tobytes()
    finally:
        for task in beaters:
            task.cancel()


async def test_a_round_that_cannot_finish_gives_every_rank_the_reason(world: World) -> None:
    legs = {rank: await leg(world, Channel.DATA, rank) for rank in RANKS}
    for stream in legs.values():
        messages, tails = chunked((torch.ones(8),), 1 << 20)
        await stream.send(messages[0].model_copy(update={"weight": 0.0}), tails[0])
    for stream in legs.values():
        refusal = (await stream.recv(10)).message()
        assert isinstance(refusal, DataPlaneError) and "total weight is zero" in refusal.reason, refusal
    # The next deposit is refused with the same reason: no later round pretends the failed one happened.
    messages, tails = chunked((torch.ones(8),), 1 << 20)
    await legs[0].send(messages[0].model_copy(update={"round": 1}), tails[0])
    refusal = (await legs[0].recv(10)).message()
    assert isinstance(refusal, DataPlaneError) and "round 0 cannot be finished" in refusal.reason


async def test_the_controller_refuses_a_host_frame_from_a_sole_host(world: World) -> None:
    world.relay.stop("replaced by a hand-driven relay", 0)
    await asyncio.gather(world.relay_task, return_exceptions=True)
    for _ in range(100):  # the real relay's seat is free once the controller saw its channel close
        if not world.plane.relays[Channel.DATA]:
            break
        await asyncio.sleep(0.05)
    stream = await open_channel("127.0.0.1", world.upstream.port, Channel.DATA, SALT, timeout=5)
    listener_nonce = stream.conn.peer_nonce
    assert listener_nonce is not None
    proof = relay_proof(
        HOST_KEY,
        host=HOST,
        channel=Channel.DATA,
        dialer_nonce=stream.conn.nonce,
        listener_nonce=listener_nonce,
    )
    await stream.send(RelayHello(host=HOST, ranks=RANKS, proof=proof))
    reply = (await stream.recv(5)).message()
    assert isinstance(reply, HelloAck) and reply.sole_host
    stream.rekey(HOST_KEY)
    messages, tails = chunked((torch.ones(4),), 1 << 20)
    frame = HostFrame(round=0, fold="mean", weight=1.0, contributors=[0], tensors=messages[0].tensors)
    await stream.send(frame, tails[0])
    refusal = (await stream.recv(5)).message()
    assert isinstance(refusal, DataPlaneError) and "only host" in refusal.reason, refusal
    assert world.plane.refusals["host_frame"] == 1
    await stream.aclose()

