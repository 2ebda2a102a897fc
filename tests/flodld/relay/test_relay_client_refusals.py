"""The rank side refuses what its relay answers wrongly, and fails its waiters cleanly.

Issue 13 point 10: a broadcast the rank cannot decode (before, the rank's reader thread died with torch's
RuntimeError and `wait_round` waited forever). Issue 29 point 10: a result whose tensors are not the
shapes and dtypes the rank deposited for that round is never handed back as that round's value.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from flodld.net.blocking import BlockingChannel
from flodld.rank.env import RankEnvironment
from flodld.rank.relay_client import RelayClient, RelayClientError
from flodld.wire.data import Broadcast, HelloAck, TensorSpec
from flodld.wire.magic import MAGIC_BYTES, Channel, channel_for_prefix

SALT = bytes(range(16))
HUGE_EMPTY = TensorSpec.model_validate({"dtype": "float32", "shape": [0] + [2**40 - 1] * 7})


def _undecodable(legs: dict[Channel, BlockingChannel]) -> None:
    undecodable = Broadcast(round=0, fold="mean", weight=1.0, contributors=[0], tensors=[HUGE_EMPTY])
    legs[Channel.DATA].send(undecodable)


class FakeRelay:
    """Accepts a rank's data and control legs, then plays `answer` on them (default: one broadcast that
    does not decode).
    """

    def __init__(self, answer: Callable[[dict[Channel, BlockingChannel]], None] = _undecodable) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.legs: dict[Channel, BlockingChannel] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for _ in range(2):
            sock, _ = self.listener.accept()
            channel = channel_for_prefix(sock.recv(MAGIC_BYTES, socket.MSG_WAITALL))
            assert channel in (Channel.DATA, Channel.CONTROL)
            leg = BlockingChannel.accept(sock, SALT, channel=channel, timeout=5)
            leg.recv(5)  # RankHello
            leg.send(HelloAck())
            self.legs[channel] = leg
        self.answer(self.legs)

    def close(self) -> None:
        self.thread.join(5)
        for leg in self.legs.values():
            leg.close()
        self.listener.close()


@pytest.fixture
def relay() -> Iterator[FakeRelay]:
    fake = FakeRelay()
    yield fake
    fake.close()


def test_a_broadcast_that_does_not_decode_fails_the_wait_instead_of_hanging(relay: FakeRelay) -> None:
    env = RankEnvironment(
        rank=0, world_size=1, local_rank=0, local_world_size=1, controller_host="127.0.0.1",
        controller_port=1, run_id="r", salt=SALT, device="cpu", backend="gloo", averaging="cpu_sync",
        relay_port=relay.port, fold="mean", cadence=1, host="h", liveness_timeout=60, heartbeat_interval=5,
    )
    client = RelayClient(env)
    try:
        with pytest.raises(RelayClientError, match="cannot decode"):
            client.wait_round(0, timeout=10)
        assert client.refused == 1
    finally:
        client.close()  # before the fake closes its control leg (a lost controller exits the process)


def _wrong_schema(legs: dict[Channel, BlockingChannel]) -> None:
    """Take the rank's deposit of round 0, answer round 0 with a float32 (1,) tensor."""
    legs[Channel.DATA].recv(5)
    spec = TensorSpec(dtype="float32", shape=[1])
    result = Broadcast(round=0, fold="mean", weight=2.0, contributors=[0, 1], tensors=[spec])
    legs[Channel.DATA].send(result, torch.tensor([100.5]).numpy().tobytes())


def test_a_result_with_other_tensors_than_the_rounds_deposit_is_refused_not_handed_back() -> None:
    relay = FakeRelay(_wrong_schema)
    env = RankEnvironment(
        rank=0, world_size=2, local_rank=0, local_world_size=2, controller_host="127.0.0.1",
        controller_port=1, run_id="r", salt=SALT, device="cpu", backend="gloo", averaging="cpu_async",
        relay_port=relay.port, fold="mean", cadence=1, host="h", liveness_timeout=60, heartbeat_interval=5,
    )
    client = RelayClient(env)
    client.use_shm = False  # framed: the fake relay answers no region offer
    try:
        assert client.deposit([torch.zeros(3)]) == 0
        with pytest.raises(
            RelayClientError,
            match=r"the result of round 0 has tensors \[float32 \(1,\)\] but this rank deposited "
            r"\[float32 \(3,\)\]: the ranks' averaging calls are out of step",
        ):
            client.wait_round(0, timeout=10)
    finally:
        client.close()
        relay.close()


def test_a_client_closed_while_its_lost_controller_exit_waits_does_not_exit(
    relay: FakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client closed during its lost-controller grace does not exit the process.

    A closed control leg makes the client exit after a short grace (a stack dump may be in flight); a
    client closed meanwhile is being shut down by its owner. CI lost a whole pytest run this way: a test
    closed its client inside the grace and the exit that followed took the test process with it.
    """
    from flodld.rank import relay_client as module

    exits: list[tuple[str, int]] = []
    monkeypatch.setattr(module, "_exit_now", lambda message, code: exits.append((message, code)))
    monkeypatch.setattr(module, "STACK_DUMP_GRACE_SECS", 1.0)
    env = RankEnvironment(
        rank=0, world_size=1, local_rank=0, local_world_size=1, controller_host="127.0.0.1",
        controller_port=1, run_id="r", salt=SALT, device="cpu", backend="gloo", averaging="cpu_sync",
        relay_port=relay.port, fold="mean", cadence=1, host="h", liveness_timeout=60, heartbeat_interval=5,
    )
    client = RelayClient(env)
    relay.close()  # the relay closes both legs: the client's control reader starts its grace
    time.sleep(0.3)
    client.close()
    time.sleep(1.5)  # past the grace
    assert exits == []
