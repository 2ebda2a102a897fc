"""Relays and the controller data plane over real loopback sockets: 2 hosts x 2 ranks, cpu_sync."""

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
from flodld.fold.codec import decode_bundle, encode_bundle
from flodld.net.stream import FramedStream, open_channel
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.control import CoordinatorHeartbeat, Heartbeat
from flodld.wire.data import Broadcast, DataPlaneError, Deposit, HelloAck, RankHello, TensorSpec
from flodld.wire.magic import Channel

SALT = bytes(range(16))
HOSTS = {"host-a": [0, 1], "host-b": [2, 3]}
# The keys each host's agent would derive at admission (flodld.wire.hostkey); the relay proves its own.
HOST_KEYS = {"host-a": bytes(range(32, 48)), "host-b": bytes(range(48, 64))}


@dataclass
class World:
    plane: DataPlane
    relays: dict[str, Relay]
    relay_tasks: dict[str, asyncio.Task[int]]
    relay_ports: dict[str, int]
    dead: list[tuple[int, str]]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    dead: list[tuple[int, str]] = []
    plane = DataPlane(
        SALT,
        HOSTS,
        host_key=HOST_KEYS.get,
        liveness_timeout=3.0,
        heartbeat_interval=0.2,
        on_rank_dead=lambda r, why: dead.append((r, why)),
    )
    mux = PortMux(ControllerCounters())
    mux.register(Channel.DATA, plane.handle_data)
    mux.register(Channel.CONTROL, plane.handle_control)
    _, port = await mux.start("127.0.0.1", 0)
    plane.start()
    relays, tasks, ports = {}, {}, {}
    for host, ranks in HOSTS.items():
        listener = socket.create_server(("127.0.0.1", 0))
        ports[host] = listener.getsockname()[1]
        spec = RelayRoleSpec(
            host=host,
            controller_host="127.0.0.1",
            controller_port=port,
            salt_hex=SALT.hex(),
            host_key_hex=HOST_KEYS[host].hex(),
            ranks=ranks,
            listen_fd=listener.detach(),
        )
        relays[host] = Relay(spec)
        tasks[host] = asyncio.create_task(relays[host].run())
    yield World(plane, relays, tasks, ports, dead)
    for relay in relays.values():
        relay.stop("test over", 0)
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await plane.close()
    await mux.close()


async def leg(port: int, channel: Channel, rank: int) -> FramedStream:
    stream = await open_channel("127.0.0.1", port, channel, SALT, timeout=5)
    await stream.send(RankHello(rank=rank))
    assert isinstance((await stream.recv(5)).message(), HelloAck)
    return stream


async def deposit(stream: FramedStream, round_number: int, value: torch.Tensor) -> None:
    specs, tail = encode_bundle([value])
    await stream.send(Deposit(round=round_number, fold="mean", weight=1.0, tensors=specs), tail)


async def receive_broadcast(stream: FramedStream) -> tuple[Broadcast, torch.Tensor]:
    frame = await stream.recv(10)
    message = frame.message()
    assert isinstance(message, Broadcast), message
    return message, decode_bundle(message.tensors, frame.tail)[0]


def host_port(world: World, rank: int) -> int:
    return next(world.relay_ports[h] for h, ranks in HOSTS.items() if rank in ranks)


async def test_cpu_sync_average_is_the_mean_of_all_deposits_and_a_leaving_rank_is_folded_out(
    world: World,
) -> None:
    legs = {rank: await leg(host_port(world, rank), Channel.DATA, rank) for rank in range(4)}
    values = {rank: torch.tensor([float(rank), 10.0 * rank]) for rank in range(4)}
    for rank, stream in legs.items():
        await deposit(stream, 0, values[rank])
    expected = torch.stack(list(values.values())).mean(dim=0)
    for stream in legs.values():
        message, average = await receive_broadcast(stream)
        assert message.round == 0 and message.contributors == [0, 1, 2, 3]
        assert torch.allclose(average, expected)

    # Rank 3 leaves mid-run: round 1 completes with the other three.
    await legs.pop(3).aclose()
    for rank, stream in legs.items():
        await deposit(stream, 1, values[rank] + 1)
    expected = torch.stack([values[rank] + 1 for rank in legs]).mean(dim=0)
    for stream in legs.values():
        message, average = await receive_broadcast(stream)
        assert message.round == 1 and message.contributors == [0, 1, 2]
        assert torch.allclose(average, expected)
    assert 3 in world.plane.stats().gone_ranks
    # Two hosts: every round crossed the controller (no relay was told it is the world's only host).
    assert world.plane.stats().rounds == 2
    assert not any(relay.deposits.sole_host for relay in world.relays.values())


async def test_a_double_deposit_is_refused_and_the_rank_is_folded_out(world: World) -> None:
    legs = {rank: await leg(host_port(world, rank), Channel.DATA, rank) for rank in range(4)}
    await deposit(legs[0], 0, torch.zeros(2))
    await deposit(legs[0], 0, torch.zeros(2))
    frame = await legs[0].recv(5)
    refusal = frame.message()
    assert isinstance(refusal, DataPlaneError) and "deposited twice" in refusal.reason
    for rank in (1, 2, 3):
        await deposit(legs[rank], 0, torch.full((2,), 3.0))
    _, average = await receive_broadcast(legs[1])
    # Rank 0's first deposit stays in the round it paid for; the refusal removed it afterwards.
    assert torch.allclose(average, torch.full((2,), 9.0 / 4))


async def test_a_silent_rank_is_declared_dead_and_heartbeats_flow_both_ways(world: World) -> None:
    controls = {rank: await leg(host_port(world, rank), Channel.CONTROL, rank) for rank in (0, 1, 2)}
    datas = {rank: await leg(host_port(world, rank), Channel.DATA, rank) for rank in (0, 1, 2, 3)}

    async def beat(rank: int, stream: FramedStream) -> None:
        while True:
            await stream.send(Heartbeat(rank=rank, step=0))
            await asyncio.sleep(0.2)

    beaters = [asyncio.create_task(beat(rank, stream)) for rank, stream in controls.items()]
    assert isinstance((await controls[0].recv(5)).message(), CoordinatorHeartbeat)
    for _ in range(100):
        if world.dead:
            break
        await asyncio.sleep(0.1)
    assert [rank for rank, _ in world.dead] == [3]
    assert "no heartbeat" in world.dead[0][1]
    for rank in (0, 1, 2):
        await deposit(datas[rank], 0, torch.full((1,), float(rank)))
    message, average = await receive_broadcast(datas[2])
    assert message.contributors == [0, 1, 2] and torch.allclose(average, torch.tensor([1.0]))
    for task in beaters:
        task.cancel()


async def test_relay_exits_cleanly_when_every_local_rank_has_left(world: World) -> None:
    streams = [await leg(world.relay_ports["host-b"], Channel.DATA, rank) for rank in (2, 3)]
    for stream in streams:
        await stream.aclose()
    assert await asyncio.wait_for(world.relay_tasks["host-b"], 10) == 0


async def test_a_deposit_that_does_not_decode_is_refused_and_the_rank_is_folded_out(world: World) -> None:
    """Issue 13 point 10: zero elements but huge dimensions is a codec refusal, never a dead handler."""
    legs = {rank: await leg(host_port(world, rank), Channel.DATA, rank) for rank in range(4)}
    huge_empty = TensorSpec.model_validate({"dtype": "float32", "shape": [0] + [2**40 - 1] * 7})
    await legs[0].send(Deposit(round=0, fold="mean", weight=1.0, tensors=[huge_empty]))
    refusal = (await legs[0].recv(5)).message()
    assert isinstance(refusal, DataPlaneError) and "tensor 0" in refusal.reason, refusal
    for rank in (1, 2, 3):
        await deposit(legs[rank], 0, torch.full((2,), float(rank)))
    message, average = await receive_broadcast(legs[1])  # rank 0 was folded out: nobody waits for it
    assert message.contributors == [1, 2, 3] and torch.allclose(average, torch.full((2,), 2.0))
    assert world.relays["host-a"].deposits.refused == 1
    assert 0 in world.plane.stats().gone_ranks
