"""The relay-facing DATA and CONTROL channels of a formed world under hostile relays."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.run import Controller
from flodld.membership.phase import Phase
from flodld.net.stream import FramedStream, open_channel
from flodld.wire.data import DataPlaneError, HelloAck, HostFrame, RelayHello, TensorSpec
from flodld.wire.errors import WireError
from flodld.wire.frames import FRAME_MAGIC, HEADER, PROTOCOL_VERSION
from flodld.wire.hostkey import join_host_key, relay_proof
from flodld.wire.join import Accept, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.messages import Message
from flodld.wire.salt import new_salt

from .daemon import CLOSE_BOUND_SECS, RawJoin, hello, options, raw_join, state


def _run_id() -> str:
    run_id = options().run_id
    assert run_id is not None
    return run_id


RUN_ID = _run_id()


TWO_HOSTS = (("h", 2), ("g", 1))


@asynccontextmanager
async def formed_world(
    hosts: tuple[tuple[str, int], ...] = TWO_HOSTS,
) -> AsyncIterator[tuple[Controller, int, RawJoin]]:
    """A formed world whose data plane is up (by default "h" with ranks [0, 1] and "g" with rank [2]);
    the join links stay open and the first host's agent is yielded.

    Two hosts by default, because a one-host world's relay folds and broadcasts itself (HelloAck
    `sole_host`) and the controller refuses every host frame from it before looking further: a host
    frame that should be refused for what it carries would be refused for that instead.
    """
    ranks = sum(devices for _, devices in hosts)
    opts = options(capacity=ranks, join=JoinConfig(join_timeout=30, target_ranks=ranks, min_rank_start=ranks))
    controller = Controller(opts)
    attach_data_plane(controller)
    _, port = await controller.start()
    agents: list[RawJoin] = []
    try:
        for host, devices in hosts:
            agent = await raw_join(port, controller.salt)
            agents.append(agent)
            agent.write(agent.conn.send_message(hello(host, devices=devices)))
            assert isinstance(await agent.next_message(), Accept)
        for agent in agents:
            assert isinstance(await agent.next_message(), WorldFormed)
        # WorldFormed is on its way before the controller enters training (it does after every
        # host's write drained), so an agent can be this fast; wait for the phase as well.
        for _ in range(500):
            if controller.phase is Phase.TRAINING:
                break
            await asyncio.sleep(0.01)
        assert controller.phase is Phase.TRAINING, controller.phase
        assert controller.window is not None and controller.window.world is not None
        first = 0
        for host, devices in hosts:  # ranks in join order
            assert sorted(controller.window.world.ranks[host]) == list(range(first, first + devices))
            first += devices
        yield controller, port, agents[0]
    finally:
        for agent in agents:
            agent.close()
        await controller.close()


async def _relay(
    port: int, key: bytes, channel: Channel, first: Message, agent: RawJoin | None = None
) -> tuple[FramedStream, Message]:
    """Dial as a relay; a RelayHello gets the proof of `agent`'s host key (rekeyed to it on HelloAck)."""
    stream = await open_channel("127.0.0.1", port, channel, key, timeout=5)
    host_key = None
    if agent is not None and isinstance(first, RelayHello):
        host_key = join_host_key(key, host="h", run_id=RUN_ID, conn=agent.conn)
        listener_nonce = stream.conn.peer_nonce
        assert listener_nonce is not None
        proof = relay_proof(host_key, host=first.host, channel=channel, dialer_nonce=stream.conn.nonce,
                            listener_nonce=listener_nonce)
        first = first.model_copy(update={"proof": proof})
    await stream.send(first)
    reply = (await stream.recv(5)).message()
    if host_key is not None and isinstance(reply, HelloAck):
        stream.rekey(host_key)
    return stream, reply


def _hello(host: str, ranks: list[int]) -> RelayHello:
    return RelayHello(host=host, ranks=ranks, proof="00" * 32)  # _relay puts the real proof in


async def _closed_without_reply(stream: FramedStream) -> None:
    with pytest.raises((EOFError, ConnectionError, WireError)):
        await stream.recv(CLOSE_BOUND_SECS)


@pytest.mark.parametrize("channel", [Channel.DATA, Channel.CONTROL])
async def test_a_relay_without_the_salt_is_dropped_unanswered(channel: Channel) -> None:
    async with formed_world() as (_, port, _agent):
        stream = await open_channel("127.0.0.1", port, channel, new_salt(), timeout=5)
        await stream.send(_hello("h", [0, 1]))
        await _closed_without_reply(stream)


@pytest.mark.parametrize(
    ("first", "fragment"),
    [
        (HelloAck(), "expected RelayHello"),
        (_hello("stranger", [0]), "not in this world"),
        (_hello("h", [0]), "claims ranks"),
        (_hello("h", [0, 1, 2]), "claims ranks"),
    ],
    ids=["not-a-hello", "unknown-host", "fewer-ranks", "extra-rank"],
)
async def test_a_relay_that_lies_about_who_it_is_gets_a_data_plane_error(
    first: Message, fragment: str
) -> None:
    async with formed_world() as (controller, port, agent):
        stream, reply = await _relay(port, controller.salt, Channel.DATA, first, agent)
        assert isinstance(reply, DataPlaneError) and fragment in reply.reason, reply
        assert controller.salt_hex not in reply.reason
        with pytest.raises(EOFError):
            await stream.recv(CLOSE_BOUND_SECS)


async def test_a_second_relay_for_the_same_host_is_refused_and_the_first_keeps_its_place() -> None:
    async with formed_world() as (controller, port, agent):
        first, reply = await _relay(port, controller.salt, Channel.DATA, _hello("h", [0, 1]), agent)
        assert isinstance(reply, HelloAck)
        _, reply = await _relay(port, controller.salt, Channel.DATA, _hello("h", [1, 0]), agent)
        assert isinstance(reply, DataPlaneError) and "already has a relay" in reply.reason
        await first.aclose()


@pytest.mark.parametrize(
    ("frame", "tail", "fragment"),
    [
        (HostFrame(round=0, fold="mean", weight=1.0, contributors=[5], tensors=[]), b"", "owns"),
        (
            HostFrame(
                round=0,
                fold="mean",
                weight=1.0,
                contributors=[0],
                tensors=[TensorSpec(dtype="float32", shape=[4])],
            ),
            b"\x00" * 3,
            "splits an element",
        ),
        (
            HostFrame(
                round=0,
                fold="mean",
                weight=1.0,
                contributors=[0],
                tensors=[TensorSpec(dtype="float32", shape=[2**39, 2**39])],
            ),
            b"",
            "multiply past",
        ),
        (
            HostFrame(round=0, fold="no-such-fold", weight=1.0, contributors=[0], tensors=[]),
            b"",
            "unknown fold",
        ),
    ],
    ids=["foreign-contributor", "short-tail", "absurd-shape", "unknown-fold"],
)
async def test_a_bad_host_frame_gets_a_data_plane_error_and_the_daemon_serves_on(
    frame: HostFrame, tail: bytes, fragment: str
) -> None:
    async with formed_world() as (controller, port, agent):
        stream, reply = await _relay(port, controller.salt, Channel.DATA, _hello("h", [0, 1]), agent)
        assert isinstance(reply, HelloAck) and not reply.sole_host
        await stream.send(frame, tail)
        refusal = (await stream.recv(10)).message()
        assert isinstance(refusal, DataPlaneError) and fragment in refusal.reason, refusal
        assert "only host" not in refusal.reason  # refused for what it carries (a world of two hosts)
        assert (await state(port))["phase"] == "training"


async def test_a_host_frame_from_the_sole_host_is_refused() -> None:
    """In a one-host world the relay broadcasts its own fold: any host frame from it is refused."""
    async with formed_world((("h", 2),)) as (controller, port, agent):
        stream, reply = await _relay(port, controller.salt, Channel.DATA, _hello("h", [0, 1]), agent)
        assert isinstance(reply, HelloAck) and reply.sole_host
        await stream.send(HostFrame(round=0, fold="mean", weight=1.0, contributors=[0], tensors=[]))
        refusal = (await stream.recv(10)).message()
        assert isinstance(refusal, DataPlaneError) and "only host" in refusal.reason, refusal


async def test_an_over_cap_tail_claim_on_the_data_channel_is_refused_unread() -> None:
    async with formed_world() as (controller, port, agent):
        stream, reply = await _relay(port, controller.salt, Channel.DATA, _hello("h", [0, 1]), agent)
        assert isinstance(reply, HelloAck)
        stream.writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, HostFrame.KIND, 1, 10, 2**32 - 1))
        await _closed_without_reply(stream)
        body = await state(port)
        assert body["phase"] == "training"
        await asyncio.sleep(0)
