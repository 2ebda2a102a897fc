"""Large tensors through a real relay and controller data plane: the buffers the relay and the controller
reuse from round to round (frame recycling, reused send buffers) never leak one round into the next.
"""

from __future__ import annotations

import asyncio
import socket

import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.fold.codec import decode_bundle, encode_bundle_parts
from flodld.net.stream import FramedStream, open_channel
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.data import Broadcast, Deposit, HelloAck, RankHello
from flodld.wire.magic import Channel

SALT = bytes(range(16))
HOSTS = {"host-a": [0, 1], "host-b": [2]}
HOST_KEYS = {"host-a": bytes(range(32, 48)), "host-b": bytes(range(48, 64))}
ELEMENTS = 3 * 1024 * 1024 // 4 + 5  # a little over 3 MiB of float32: the large-frame paths


async def leg(port: int, rank: int) -> FramedStream:
    stream = await open_channel("127.0.0.1", port, Channel.DATA, SALT, timeout=5)
    await stream.send(RankHello(rank=rank))
    assert isinstance((await stream.recv(5)).message(), HelloAck)
    return stream


async def test_rounds_of_large_tensors_average_exactly_round_after_round() -> None:
    plane = DataPlane(SALT, HOSTS, host_key=HOST_KEYS.get, heartbeat_interval=0.5)
    mux = PortMux(ControllerCounters())
    mux.register(Channel.DATA, plane.handle_data)
    mux.register(Channel.CONTROL, plane.handle_control)
    _, port = await mux.start("127.0.0.1", 0)
    plane.start()
    relays, tasks, relay_ports = [], [], {}
    for host, ranks in HOSTS.items():
        listener = socket.create_server(("127.0.0.1", 0))
        relay_ports[host] = listener.getsockname()[1]
        relay = Relay(
            RelayRoleSpec(
                host=host,
                controller_host="127.0.0.1",
                controller_port=port,
                salt_hex=SALT.hex(),
                host_key_hex=HOST_KEYS[host].hex(),
                ranks=ranks,
                listen_fd=listener.detach(),
            )
        )
        relays.append(relay)
        tasks.append(asyncio.create_task(relay.run()))
    try:
        legs = {rank: await leg(relay_ports[host], rank) for host, ranks in HOSTS.items() for rank in ranks}
        for round_number in range(3):
            values = {
                rank: torch.arange(ELEMENTS, dtype=torch.float32) * (rank + 1) + round_number for rank in legs
            }

            async def one(
                rank: int,
                stream: FramedStream,
                values: dict[int, torch.Tensor] = values,
                round_number: int = round_number,
            ) -> torch.Tensor:
                specs, parts = encode_bundle_parts([values[rank]])
                await stream.send(Deposit(round=round_number, fold="sum", weight=1.0, tensors=specs), parts)
                frame = await stream.recv(60)
                message = frame.message()
                assert isinstance(message, Broadcast) and message.round == round_number
                return decode_bundle(message.tensors, frame.tail_view)[0]

            results = await asyncio.gather(*(one(rank, stream) for rank, stream in legs.items()))
            # Sums of small integers in float32 are exact whatever the order.
            expected = sum(values.values(), torch.zeros(ELEMENTS))
            for result in results:
                assert torch.equal(result, expected), round_number
    finally:
        for relay in relays:
            relay.stop("test over", 0)
        await asyncio.gather(*tasks, return_exceptions=True)
        await plane.close()
        await mux.close()
