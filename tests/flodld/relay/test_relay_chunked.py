"""Chunked deposits through real relays and the controller's data plane (loopback sockets, encrypted).

- the broadcast equals the unchunked fold of the same tree bit for bit (relays sum their ranks in rank
  order, the controller sums hosts in host order, then divides), at chunk sizes that do not divide the
  tensors, for a multi-tensor bundle, at 2, 3 and 4 ranks, round after round;
- the fold is pipelined: the first chunk of the broadcast arrives while every rank still holds back the
  last chunk of its deposit (store-and-forward of whole frames could not send anything yet);
- a rank that leaves in the middle of its deposit lowers its host's weight from the next chunk on, and
  the controller folds that host on (it refused the host's next chunk before: "changed its weight").
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.fold.base import Bundle, fold_from_spec
from flodld.fold.chunks import Assembly, Layout, split_parts
from flodld.fold.codec import encode_bundle_parts
from flodld.net.stream import FramedStream, open_channel
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.data import Broadcast, Deposit, HelloAck, RankHello
from flodld.wire.magic import Channel

SALT = bytes(range(16))
WORLDS = {
    2: {"host-a": [0], "host-b": [1]},
    3: {"host-a": [0, 1], "host-b": [2]},
    4: {"host-a": [0, 1], "host-b": [2, 3]},
}
HOST_KEYS = {"host-a": bytes(range(32, 48)), "host-b": bytes(range(48, 64))}


def deposit(rank: int, round_number: int) -> Bundle:
    generator = torch.Generator().manual_seed(100 * round_number + rank)
    return (
        torch.randn(75_011, generator=generator) * 1e4,  # prime length
        torch.randn(
            333, dtype=torch.float16, generator=generator
        ),  # odd bytes: the next tensor starts unaligned
        torch.randn(17, 19, dtype=torch.float64, generator=generator),
    )


def tree_mean(hosts: dict[str, list[int]], deposits: dict[int, Bundle]) -> Bundle:
    fold = fold_from_spec("mean")
    partials = []
    for host in sorted(hosts):
        partial = fold.identity(deposits[hosts[host][0]])
        for rank in sorted(hosts[host]):
            partial = fold.add(partial, deposits[rank])
        partials.append(partial)
    total = fold.identity(partials[0])
    for partial in partials:
        total = fold.add(total, partial)
    return fold.finish(total, float(len(deposits)))


@pytest.fixture
async def world(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[dict[str, list[int]], dict[int, FramedStream]]]:
    hosts = WORLDS[request.param]
    plane = DataPlane(SALT, hosts, host_key=HOST_KEYS.get, heartbeat_interval=0.5)
    mux = PortMux(ControllerCounters())
    mux.register(Channel.DATA, plane.handle_data)
    mux.register(Channel.CONTROL, plane.handle_control)
    _, port = await mux.start("127.0.0.1", 0)
    plane.start()
    relays, tasks, legs = [], [], {}
    for host, ranks in hosts.items():
        listener = socket.create_server(("127.0.0.1", 0))
        relay_port = listener.getsockname()[1]
        spec = RelayRoleSpec(
            host=host,
            controller_host="127.0.0.1",
            controller_port=port,
            salt_hex=SALT.hex(),
            host_key_hex=HOST_KEYS[host].hex(),
            ranks=ranks,
            listen_fd=listener.detach(),
        )
        relays.append(Relay(spec))
        tasks.append(asyncio.create_task(relays[-1].run()))
        for rank in ranks:
            stream = await open_channel("127.0.0.1", relay_port, Channel.DATA, SALT, timeout=5)
            await stream.send(RankHello(rank=rank))
            assert isinstance((await stream.recv(5)).message(), HelloAck)
            legs[rank] = stream
    try:
        yield hosts, legs
    finally:
        for relay in relays:
            relay.stop("test over", 0)
        await asyncio.gather(*tasks, return_exceptions=True)
        await plane.close()
        await mux.close()


def chunked(tensors: Bundle, chunk_bytes: int) -> tuple[list[Deposit], list[list[memoryview]]]:
    specs, parts = encode_bundle_parts(tensors)
    ranges = Layout(specs).ranges(chunk_bytes)
    messages = [
        Deposit(round=0, fold="mean", weight=1.0, tensors=specs, offset=offset) for offset, _ in ranges
    ]
    return messages, list(split_parts(parts, ranges))


async def receive_round(stream: FramedStream, round_number: int) -> tuple[int, Bundle]:
    assembly: Assembly | None = None
    chunks = 0
    while True:
        frame = await stream.recv(60)
        message = frame.message()
        assert isinstance(message, Broadcast) and message.round == round_number
        if assembly is None:
            assembly = Assembly(message.tensors)
        chunks += 1
        if assembly.add(message.offset, frame.tail_view):
            return chunks, assembly.tensors


def assert_bitwise_equal(got: Bundle, want: Bundle) -> None:
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, index
        assert torch.equal(mine.view(-1).view(torch.uint8), theirs.contiguous().view(-1).view(torch.uint8)), (
            index
        )


@pytest.mark.parametrize("world", [2, 3, 4], indirect=True, ids=["2-ranks", "3-ranks", "4-ranks"])
@pytest.mark.parametrize("chunk_bytes", [100_003, 1 << 20])
async def test_chunked_rounds_through_relays_equal_the_unchunked_tree_bit_for_bit(
    world: tuple[dict[str, list[int]], dict[int, FramedStream]], chunk_bytes: int
) -> None:
    hosts, legs = world
    for round_number in range(2):
        deposits = {rank: deposit(rank, round_number) for rank in legs}

        async def one(
            rank: int,
            stream: FramedStream,
            deposits: dict[int, Bundle] = deposits,
            number: int = round_number,
        ) -> tuple[int, Bundle]:
            messages, tails = chunked(deposits[rank], chunk_bytes)
            for message, tail in zip(messages, tails, strict=True):
                await stream.send(message.model_copy(update={"round": number}), tail)
            return await receive_round(stream, number)

        results = await asyncio.gather(*(one(rank, stream) for rank, stream in legs.items()))
        want = tree_mean(hosts, deposits)
        for chunks, got in results:
            assert chunks == len(chunked(deposits[0], chunk_bytes)[0])
            assert_bitwise_equal(got, want)


@pytest.mark.parametrize("world", [4], indirect=True, ids=["4-ranks"])
async def test_the_first_broadcast_chunk_arrives_before_any_rank_sent_its_last_chunk(
    world: tuple[dict[str, list[int]], dict[int, FramedStream]],
) -> None:
    hosts, legs = world
    deposits = {rank: deposit(rank, 0) for rank in legs}
    held_back = {}
    for rank, stream in legs.items():
        messages, tails = chunked(deposits[rank], 65_536)
        assert len(messages) > 2
        for chunk, tail in zip(messages[:-1], tails[:-1], strict=True):
            await stream.send(chunk, tail)
        held_back[rank] = (messages[-1], tails[-1])
    assemblies = {}
    for rank, stream in legs.items():  # every rank hears chunk 0 of the result with its last chunk unsent
        frame = await stream.recv(30)
        message = frame.message()
        assert isinstance(message, Broadcast) and message.offset == 0 and message.round == 0
        assemblies[rank] = Assembly(message.tensors)
        assert not assemblies[rank].add(0, frame.tail_view)
    for rank, (last, tail) in held_back.items():
        await legs[rank].send(last, tail)
    want = tree_mean(hosts, deposits)
    for rank, stream in legs.items():  # the rest of the round arrives in order and completes it
        while True:
            frame = await stream.recv(30)
            message = frame.message()
            assert isinstance(message, Broadcast)
            if assemblies[rank].add(message.offset, frame.tail_view):
                break
        assert_bitwise_equal(assemblies[rank].tensors, want)


@pytest.mark.parametrize("world", [4], indirect=True, ids=["4-ranks"])
async def test_a_rank_leaving_mid_deposit_lowers_its_hosts_weight_and_the_round_completes(
    world: tuple[dict[str, list[int]], dict[int, FramedStream]],
) -> None:
    _, legs = world
    messages, tails = chunked(deposit(1, 0), 100_003)
    await legs[1].send(messages[0], tails[0])  # host-a's rank 1 leaves after its first chunk
    await legs.pop(1).aclose()
    deposits = {rank: deposit(rank, 0) for rank in legs}

    async def one(rank: int, stream: FramedStream) -> tuple[int, Bundle]:
        messages, tails = chunked(deposits[rank], 100_003)
        for message, tail in zip(messages, tails, strict=True):
            await stream.send(message, tail)
        return await receive_round(stream, 0)

    results = await asyncio.gather(*(one(rank, stream) for rank, stream in legs.items()))
    # The last chunk (where the float64 tensor lies) holds the three ranks that stayed, each at weight 1.
    want = tree_mean({"host-a": [0], "host-b": [2, 3]}, deposits)
    for _, got in results:
        assert_bitwise_equal((got[2],), (want[2],))
