"""Averager semantics over a real relay and controller data plane; ranks are threads with blocking clients."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

import pytest
import torch

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.rank.averaging import Averager, all_average
from flodld.rank.env import RankEnvironment
from flodld.rank.relay_client import RelayClient
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.magic import Channel

SALT = bytes(range(16, 32))
T = TypeVar("T")
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


def run_ranks(plane: Plane, program: Callable[[int, RelayClient], T], ranks: int = 2) -> list[T]:
    """`program(rank, client)` on one thread per rank, each with its own relay client; the results by rank."""
    clients = [plane.client(rank) for rank in range(ranks)]
    try:
        futures = [in_thread(lambda rank=rank: program(rank, clients[rank])) for rank in range(ranks)]
        return [future.result(60) for future in futures]  # type: ignore[misc]
    finally:
        for client in clients:
            client.close()


def test_async_applies_its_own_rounds_elastic_update_and_keeps_the_local_steps(plane: Plane) -> None:
    def program(rank: int, client: RelayClient) -> list[float]:
        averager = Averager("cpu_async", cadence=2, client=client)  # alpha 0.5
        out = []
        for step in range(1, 7):
            (value,) = averager.step([torch.tensor([float(10 * step + rank)])])
            out.append(value.item())
        (last,) = averager.finish([torch.tensor([100.0 + rank])])
        return [*out, last.item()]

    results = run_ranks(plane, program)
    # Calls 1, 3, 5 are local. Call 2 deposits 20 + rank (nothing out yet). Call 4 applies round 0
    # (mean 20.5): 40 + r + 0.5 * (20.5 - (20 + r)), i.e. 40.25 / 40.75, and deposits that (mean 40.5).
    # Call 6: 60 + r + 0.5 * (40.5 - 40.25 / 40.75); finish applies call 6's round (mean 60.5).
    assert results[0] == [10.0, 20.0, 30.0, 40.25, 50.0, 60.125, 100.0 + 0.5 * (60.5 - 60.125)]
    assert results[1] == [11.0, 21.0, 31.0, 40.75, 51.0, 60.875, 101.0 + 0.5 * (60.5 - 60.875)]


def test_mixing_all_average_with_async_steps_hands_each_call_its_own_rounds_result(plane: Plane) -> None:
    """The issue-29 reproduction: an all_average's result came back from the next async step."""

    def program(rank: int, client: RelayClient) -> list[list[float]]:
        out = [all_average([torch.tensor([100.0 + rank])], client=client)[0].tolist()]
        averager = Averager("cpu_async", cadence=1, client=client)
        for step in range(3):
            out.append(averager.step([torch.zeros(3) + step])[0].tolist())
            out.append(all_average([torch.tensor([float(step), float(rank)])], client=client)[0].tolist())
        return out

    for rank, result in enumerate(run_ranks(plane, program)):
        # Equal zeros-plus-step deposits: each elastic update adds nothing, each step keeps its own values.
        assert result == [
            [100.5], [0.0] * 3, [0.0, 0.5], [1.0] * 3, [1.0, 0.5], [2.0] * 3, [2.0, 0.5]
        ], rank


def test_async_refuses_what_it_cannot_average_before_depositing(plane: Plane) -> None:
    client = plane.client(0)
    try:
        with pytest.raises(ValueError, match="cpu_async pulls parameters towards the world's mean"):
            Averager("cpu_async", cadence=1, fold="sum", client=client).step([torch.ones(2)])
        with pytest.raises(ValueError, match=r"tensor 1 is torch\.int64"):
            mixed = [torch.ones(2), torch.ones(2, dtype=torch.long)]
            Averager("cpu_async", cadence=1, client=client).step(mixed)
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
            Averager("cpu_async", alpha=1.5, client=client)
        assert client.next_round == 0  # nothing was deposited
    finally:
        client.close()


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
