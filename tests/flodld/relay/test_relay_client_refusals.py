"""Issue 13 point 10, rank side: a broadcast the rank cannot decode fails its waiters cleanly.

Before, the rank's reader thread died with torch's RuntimeError and `wait_round` waited forever.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from flodld.net.blocking import BlockingChannel
from flodld.rank.env import RankEnvironment
from flodld.rank.relay_client import RelayClient, RelayClientError
from flodld.wire.data import Broadcast, HelloAck, TensorSpec
from flodld.wire.magic import MAGIC_BYTES, Channel, channel_for_prefix

SALT = bytes(range(16))
HUGE_EMPTY = TensorSpec.model_validate({"dtype": "float32", "shape": [0] + [2**40 - 1] * 7})


class FakeRelay:
    """Accepts a rank's data and control legs, then sends one broadcast that does not decode."""

    def __init__(self) -> None:
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
        self.legs[Channel.DATA].send(
            Broadcast(round=0, fold="mean", weight=1.0, contributors=[0], tensors=[HUGE_EMPTY])
        )

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
