"""The store hands small replies to the socket without waiting for each to drain, yet a client that sends
requests and never reads its replies still costs the controller at most about one reply of buffer.
"""

from __future__ import annotations

import asyncio
import typing

from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.store import NOWAIT_REPLY_BYTES, StoreService
from flodld.net.stream import open_channel
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt
from flodld.wire.store import StoreGet, StoreHello, StoreOk, StoreSet, StoreValue

VALUE = b"v" * (NOWAIT_REPLY_BYTES // 2)
REQUESTS = 3000  # ~100 MB of replies if each were queued without waiting


async def test_a_client_that_never_reads_its_replies_is_held_to_one_buffered_reply() -> None:
    salt, counters = new_salt(), ControllerCounters()
    service = StoreService("bp", salt, counters)
    mux = PortMux(counters)
    mux.register(Channel.RENDEZVOUS, service.handle)
    _, port = await mux.start("127.0.0.1", 0)
    try:
        stream = await open_channel(
            "127.0.0.1", port, Channel.RENDEZVOUS, salt, timeout=10, max_tail=len(VALUE)
        )
        await stream.send(StoreHello(run_id="bp"))
        assert isinstance((await stream.recv(10)).message(), StoreOk)
        await stream.send(StoreSet(key="k"), VALUE)
        assert isinstance((await stream.recv(10)).message(), StoreOk)

        transport = typing.cast(asyncio.Transport, stream.writer.transport)
        transport.pause_reading()  # from here on the client reads nothing
        for _ in range(REQUESTS):
            stream.send_nowait(StoreGet(key="k", timeout=1.0))
        peak = 0
        for _ in range(40):
            await asyncio.sleep(0.05)
            peak = max([peak, *(w.transport.get_write_buffer_size() for w in mux._writers)])
        answered = counters.frames_out["rendezvous"]
        assert answered < REQUESTS / 2, f"{answered} replies went out to a client that reads nothing"
        # Kernel buffers hold what they hold; the controller's own queue stays at about one reply
        # (plus the transport's high-water mark), not the ~100 MB a wait-free reply path would queue.
        assert peak <= 4 * NOWAIT_REPLY_BYTES, f"the controller buffered {peak} bytes for one client"

        transport.resume_reading()  # the client reads again: every reply arrives, in order
        for _ in range(REQUESTS):
            frame = await stream.recv(30)
            assert isinstance(frame.message(), StoreValue) and frame.tail == VALUE
        stream.close()
    finally:
        await mux.close()
