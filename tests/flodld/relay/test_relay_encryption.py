"""Issue 21: an on-path observer between a rank and its relay, and between a relay and the controller,
sees no plaintext: not the tensors deposited, not the averages broadcast, not the host's name.
"""

from __future__ import annotations

import asyncio
import socket

import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.fold.codec import decode_bundle, encode_bundle
from flodld.net.stream import FramedStream, open_channel
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.control import Heartbeat
from flodld.wire.data import Broadcast, Deposit, HelloAck, RankHello
from flodld.wire.magic import Channel, magic_prefix
from tests.flodld.relay.recorder import RecordingForwarder

SALT = bytes(range(16))
HOST = "secret-host-name.example"
HOST_KEY = bytes(range(32, 48))
RANKS = [0, 1]


def known_tensor(rank: int) -> torch.Tensor:
    # A value whose 4-byte pattern repeats: any 16-byte run of it on the wire would be found.
    return torch.full((4096,), 1234.5 + rank, dtype=torch.float32)


def pattern(value: float) -> bytes:
    return torch.full((8,), value, dtype=torch.float32).numpy().tobytes()


async def leg(port: int, channel: Channel, rank: int) -> FramedStream:
    stream = await open_channel("127.0.0.1", port, channel, SALT, timeout=5)
    await stream.send(RankHello(rank=rank))
    assert isinstance((await stream.recv(5)).message(), HelloAck)
    return stream


async def test_no_plaintext_on_the_rank_legs_or_the_relay_upstreams() -> None:
    plane = DataPlane(SALT, {HOST: RANKS}, host_key={HOST: HOST_KEY}.get, heartbeat_interval=0.1)
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
    legs_observer = RecordingForwarder(relay_port)
    try:
        data = {rank: await leg(legs_observer.port, Channel.DATA, rank) for rank in RANKS}
        control = {rank: await leg(legs_observer.port, Channel.CONTROL, rank) for rank in RANKS}
        for rank, stream in data.items():
            specs, tail = encode_bundle([known_tensor(rank)])
            await stream.send(Deposit(round=0, fold="mean", weight=1.0, tensors=specs), tail)
        for rank in RANKS:
            await control[rank].send(Heartbeat(rank=rank, step=7))
        for stream in data.values():
            frame = await stream.recv(10)
            message = frame.message()
            assert isinstance(message, Broadcast)
            (mean,) = decode_bundle(message.tensors, frame.tail)
            assert torch.equal(mean, torch.full((4096,), 1235.0))
        await asyncio.sleep(0.3)  # coordinator heartbeats go down the control legs too
    finally:
        relay.stop("test over", 0)
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()
        await mux.close()
        upstream.close()
        legs_observer.close()

    for observer, channels in (
        (upstream, (Channel.DATA, Channel.CONTROL)),
        (legs_observer, (Channel.DATA, Channel.CONTROL)),
    ):
        transcripts = observer.recorded()
        wire = b"\x00".join(transcripts)
        for channel in channels:  # the observer did see each channel's traffic
            assert any(t.startswith(magic_prefix(channel)) and len(t) > 100 for t in transcripts), channel
        for value in (1234.5, 1235.5, 1235.0):  # deposits and the mean
            assert pattern(value) not in wire, value
        assert HOST.encode() not in wire
        assert b"Deposit" not in wire and b'"round"' not in wire and b'"rank"' not in wire
