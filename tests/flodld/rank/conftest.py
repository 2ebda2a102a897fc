"""A store service on a loopback mux, on its own event-loop thread (the ControllerStore client blocks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flodld.controller.metrics import ControllerCounters
from flodld.controller.mux import PortMux
from flodld.controller.store import StoreService
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt


@dataclass
class StoreServer:
    port: int
    salt: bytes
    run_id: str
    service: StoreService


@pytest.fixture
def store_server() -> Iterator[StoreServer]:
    """A mux with only the store service, on its own event loop thread (the client blocks)."""
    loop = asyncio.new_event_loop()
    salt = new_salt()
    started: dict[str, object] = {}
    ready = threading.Event()

    async def main() -> None:
        counters = ControllerCounters()
        service = StoreService("run-1", salt, counters)
        mux = PortMux(counters)
        mux.register(Channel.RENDEZVOUS, service.handle)
        _, port = await mux.start("127.0.0.1", 0)
        started.update(port=port, service=service, mux=mux)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(main(), loop).result(10)
    ready.wait(10)
    service = started["service"]
    assert isinstance(service, StoreService)
    yield StoreServer(int(started["port"]), salt, "run-1", service)  # type: ignore[call-overload]
    mux = started["mux"]
    assert isinstance(mux, PortMux)
    asyncio.run_coroutine_threadsafe(mux.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


