"""A run's channels on a borrowed port: served from `listen()` on, one table, taken off again at close."""

from __future__ import annotations

import asyncio

import pytest

from flodld.controller.mux import ChannelHandler, PortMux
from flodld.controller.run import RUN_CHANNELS, Controller
from flodld.controller.status.metrics import ControllerCounters
from flodld.wire.magic import Channel, magic_prefix

from .agents import eventually, options


async def _dial(port: int, channel: Channel) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(magic_prefix(channel))
    await writer.drain()
    return reader, writer


async def _dropped_unserved(mux: PortMux, port: int, channel: Channel) -> None:
    before = mux.counters.dropped["no_handler"]
    reader, writer = await _dial(port, channel)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the mux closed it
    writer.close()
    assert mux.counters.dropped["no_handler"] == before + 1


async def test_run_channels_and_registered_ones_are_served_until_the_run_closes() -> None:
    assert set(RUN_CHANNELS) == {Channel.JOIN, Channel.RENDEZVOUS}
    mux = PortMux(ControllerCounters())
    address = await mux.start("127.0.0.1", 0)
    port = address[1]
    try:
        await _dropped_unserved(mux, port, Channel.RENDEZVOUS)  # no run yet
        run = Controller(options(capacity=2), mux=mux, address=address)
        await run.listen()

        reached: list[Channel] = []

        def handler(channel: Channel) -> ChannelHandler:
            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                reached.append(channel)

            return serve

        for served_by_the_run in (Channel.JOIN, Channel.RENDEZVOUS, Channel.HTTP):
            with pytest.raises(ValueError, match="served by the controller itself"):
                run.register_channels(
                    {Channel.DATA: handler(Channel.DATA), served_by_the_run: handler(Channel.JOIN)}
                )
        await _dropped_unserved(mux, port, Channel.DATA)  # a refused table registers nothing

        run.register_channels(
            {Channel.DATA: handler(Channel.DATA), Channel.CONTROL: handler(Channel.CONTROL)}
        )
        for count, channel in enumerate((Channel.DATA, Channel.CONTROL), start=1):
            _, writer = await _dial(port, channel)

            def arrived(count: int = count) -> bool:
                return len(reached) == count

            await eventually(arrived)
            assert reached[-1] is channel
            writer.close()
        no_handler = mux.counters.dropped["no_handler"]
        _, writer = await _dial(port, Channel.RENDEZVOUS)  # the store's handshake now holds it
        await asyncio.sleep(0.2)
        assert mux.counters.dropped["no_handler"] == no_handler
        writer.close()

        await run.close()
        for channel in (Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL):
            await _dropped_unserved(mux, port, channel)
    finally:
        await mux.close()
