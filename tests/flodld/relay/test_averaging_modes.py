"""Averager semantics over a real relay and controller data plane; ranks are threads with blocking clients."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.metrics import ControllerCounters
from flodld.controller.mux import PortMux
from flodld.rank.averaging import Averager
from flodld.rank.env import RankEnvironment
from flodld.rank.relay_client import RelayClient
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.magic import Channel

SALT = bytes(range(16, 32))
HOST_KEY = bytes(range(32, 48))  # what the agent would derive at admission (flodld.wire.hostkey)


class Plane:
    """Controller data plane and one relay per host (default: one host "h" with ranks 0 and 1), on an
    event loop in a thread.
    """

    def __init__(self, hosts: dict[str, list[int]] | None = None) -> None:
        self.hosts = hosts or {"h": [0, 1]}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relays: dict[str, Relay] = {}
        self.relay_ports: dict[str, int] = {}
        self.call(self._start())
        first = next(iter(self.hosts))
        self.relay, self.relay_port = self.relays[first], self.relay_ports[first]

    def call(self, coroutine: object) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)  # type: ignore[arg-type]

    @staticmethod
    def host_key(host: str) -> bytes:
        return HOST_KEY if host == "h" else hashlib.sha256(host.encode()).digest()[:16]

    async def _start(self) -> None:
        self.plane = DataPlane(
            SALT, self.hosts, host_key=self.host_key, liveness_timeout=60, heartbeat_interval=0.5
        )
        self.mux = PortMux(ControllerCounters())
        self.mux.register(Channel.DATA, self.plane.handle_data)
        self.mux.register(Channel.CONTROL, self.plane.handle_control)
        _, port = await self.mux.start("127.0.0.1", 0)
        self.plane.start()
        self.relay_tasks: list[asyncio.Future[int]] = []
        for host, ranks in self.hosts.items():
            listener = socket.create_server(("127.0.0.1", 0))
            self.relay_ports[host] = listener.getsockname()[1]
            self.relays[host] = Relay(RelayRoleSpec(
                host=host, controller_host="127.0.0.1", controller_port=port, salt_hex=SALT.hex(),
                host_key_hex=self.host_key(host).hex(), ranks=ranks, listen_fd=listener.detach(),
            ))
            self.relay_tasks.append(asyncio.ensure_future(self.relays[host].run()))

    def client(self, rank: int) -> RelayClient:
        host = next(host for host, ranks in self.hosts.items() if rank in ranks)
        world = sum(len(ranks) for ranks in self.hosts.values())
        env = RankEnvironment(
            rank=rank, world_size=world, local_rank=rank, local_world_size=len(self.hosts[host]),
            controller_host="127.0.0.1", controller_port=1, run_id="r", salt=SALT, device="cpu",
            backend="gloo", averaging="cpu_sync", relay_port=self.relay_ports[host], fold="mean", cadence=1,
            host=host, liveness_timeout=60, heartbeat_interval=0.5,
        )
        return RelayClient(env)

    def close(self) -> None:
        async def stop() -> None:
            for relay in self.relays.values():
                relay.stop("test over", 0)
            await self.plane.close()
            await self.mux.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def plane() -> Iterator[Plane]:
    world = Plane()
    yield world
    world.close()


def in_thread(function: object) -> Future[object]:
    future: Future[object] = Future()

    def run() -> None:
        try:
            future.set_result(function())  # type: ignore[operator]
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


def test_cadence_averages_every_kth_step_and_returns_local_values_between(plane: Plane) -> None:
    clients = [plane.client(0), plane.client(1)]
    try:
        averagers = [Averager("cpu_cadence", cadence=2, client=client) for client in clients]

        def steps(rank: int) -> list[float]:
            return [
                averagers[rank].step([torch.tensor([float(rank * 10 + step)])])[0].item() for step in range(4)
            ]

        futures = [in_thread(lambda rank=rank: steps(rank)) for rank in (0, 1)]
        results = [future.result(30) for future in futures]
        # Steps 1 and 3 are local; steps 2 and 4 are the mean of both ranks' values at that step.
        assert results[0] == [0.0, 6.0, 2.0, 8.0]
        assert results[1] == [10.0, 6.0, 12.0, 8.0]
    finally:
        for client in clients:
            client.close()


def test_async_never_waits_and_hands_out_the_last_available_average(plane: Plane) -> None:
    fast, slow = plane.client(0), plane.client(1)
    try:
        fast_averager = Averager("cpu_async", client=fast)
        slow_averager = Averager("cpu_async", client=slow)
        first = fast_averager.step([torch.tensor([2.0])])
        second = fast_averager.step([torch.tensor([4.0])])  # round 0 still open: no second deposit
        assert (first[0].item(), second[0].item()) == (2.0, 4.0)
        assert fast.next_round == 1
        slow_averager.step([torch.tensor([6.0])])  # completes round 0: mean(2, 6) = 4
        for _ in range(200):
            if fast.latest is not None:
                break
            threading.Event().wait(0.05)
        third = fast_averager.step([torch.tensor([100.0])])
        assert third[0].item() == 4.0  # the newest finished average, not its own value
        assert fast.next_round == 2  # and it deposited for round 1
    finally:
        fast.close()
        slow.close()


RANK_PROGRAM = """
import time
from flodld.rank.env import read_rank_environment
from flodld.rank.relay_client import connect_relay
connect_relay(read_rank_environment())
print("connected", flush=True)
time.sleep(120)
print("still hanging", flush=True)
"""


@pytest.mark.multiproc
def test_a_rank_that_stops_hearing_the_controller_exits_instead_of_hanging(plane: Plane) -> None:
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "FLODL_CONTROLLER": "127.0.0.1:1",
        "FLODL_INTERNAL_SALT": SALT.hex(),
        "FLODL_RELAY_PORT": str(plane.relay_port),
        "FLODL_LIVENESS_TIMEOUT_SECS": "2",
        "FLODL_HEARTBEAT_INTERVAL_SECS": "0.2",
        "OMP_NUM_THREADS": "1",
    }
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_PROGRAM],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert rank.stdout is not None
        assert rank.stdout.readline().strip() == "connected"
        # The coordinator goes silent (its heartbeat ticker stops) while every socket stays open.
        asyncio.run_coroutine_threadsafe(plane.plane.close(), plane.loop).result(10)
        output, _ = rank.communicate(timeout=60)
    finally:
        rank.kill()
    assert rank.returncode == 1, output
    assert "lost the controller (no word from the controller for 2s)" in output
    assert "still hanging" not in output
