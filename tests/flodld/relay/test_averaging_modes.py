"""Averager semantics over a real relay and controller data plane; ranks are threads with blocking clients."""

from __future__ import annotations

import asyncio
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
    """Controller data plane and one relay for ranks 0 and 1, on an event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relay_port, self.relay_task = self.call(self._start())

    def call(self, coroutine: object) -> tuple[int, Future[int]]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)  # type: ignore[arg-type]

    async def _start(self) -> tuple[int, Future[int]]:
        self.plane = DataPlane(
            SALT, {"h": [0, 1]}, host_key={"h": HOST_KEY}.get, liveness_timeout=60, heartbeat_interval=0.5
        )
        self.mux = PortMux(ControllerCounters())
        self.mux.register(Channel.DATA, self.plane.handle_data)
        self.mux.register(Channel.CONTROL, self.plane.handle_control)
        _, port = await self.mux.start("127.0.0.1", 0)
        self.plane.start()
        listener = socket.create_server(("127.0.0.1", 0))
        relay_port = listener.getsockname()[1]
        self.relay = Relay(RelayRoleSpec(host="h", controller_host="127.0.0.1", controller_port=port,
                                         salt_hex=SALT.hex(), host_key_hex=HOST_KEY.hex(), ranks=[0, 1],
                                         listen_fd=listener.detach()))
        task = asyncio.ensure_future(self.relay.run())
        return relay_port, task  # type: ignore[return-value]

    def client(self, rank: int) -> RelayClient:
        env = RankEnvironment(
            rank=rank, world_size=2, local_rank=rank, local_world_size=2, controller_host="127.0.0.1",
            controller_port=1, run_id="r", salt=SALT, device="cpu", backend="gloo", averaging="cpu_sync",
            relay_port=self.relay_port, fold="mean", cadence=1, host="h", liveness_timeout=60,
            heartbeat_interval=0.5,
        )
        return RelayClient(env)

    def close(self) -> None:
        async def stop() -> None:
            self.relay.stop("test over", 0)
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
