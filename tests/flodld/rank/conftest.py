"""A store service on a loopback mux, on its own event-loop thread (the ControllerStore client blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.store import StoreService
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt, salt_to_hex


@dataclass
class StoreServer:
    port: int
    salt: bytes
    run_id: str
    service: StoreService

    def start_ranks(self, script: str, world: int) -> list[subprocess.Popen[str]]:
        """WORLD processes of `python -c SCRIPT PORT SALT RANK WORLD` (gloo on lo), output piped."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        argv = [sys.executable, "-c", script, str(self.port), salt_to_hex(self.salt)]
        pipe = subprocess.PIPE
        return [
            subprocess.Popen([*argv, str(rank), str(world)], stdout=pipe, stderr=pipe, text=True, env=env)
            for rank in range(world)
        ]


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




class ResettingProxy:
    """A TCP relay in front of a store server that can lose one reply: `cut_next_reply(hook)` makes it
    drop the next bytes the server sends, run `hook()` (the server has applied the request by then),
    and reset both sides of that connection. Later connections are relayed normally.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.cuts = 0
        self._hook: Callable[[], None] | None = None
        self._armed = threading.Event()
        self._closed = threading.Event()
        self._links: list[threading.Event] = []
        self._reset: set[threading.Event] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next_reply(self, hook: Callable[[], None] | None = None) -> None:
        self._hook = hook
        self._armed.set()

    def reset_all(self) -> None:
        """Reset every relayed connection now (requests in flight stay parked on the server)."""
        for dead in self._links:
            dead.set()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.connections += 1
            dead = threading.Event()
            self._links.append(dead)
            threading.Thread(target=self._pump, args=(client, upstream, dead, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, dead, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, dead: threading.Event, replies: bool) -> None:
        try:
            while not dead.is_set() and not self._closed.is_set():
                ready, _, _ = select.select([source], [], [], 0.1)
                if not ready:
                    continue
                data = source.recv(1 << 20)
                if not data:
                    break
                if replies and self._armed.is_set():
                    self._armed.clear()
                    self.cuts += 1
                    if self._hook is not None:
                        self._hook()
                    break  # the reply is lost
                sink.sendall(data)
        except OSError:
            pass
        with self._lock:  # the first pump of a link to stop resets both of its sockets
            first = dead not in self._reset
            self._reset.add(dead)
            dead.set()
        if first:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                sock.close()


@pytest.fixture
def resetting_proxy(store_server: StoreServer) -> Iterator[ResettingProxy]:
    proxy = ResettingProxy(store_server.port)
    yield proxy
    proxy.close()
