"""The rendezvous store of a real `flodld serve` daemon under oversized and amplifying requests.

Issue 13 point 8: a `multi_get` naming one big key many times made the controller join every copy
before any size check (a 112-byte request for 12 copies of a 40 MiB key took it from 211 to 611 MiB),
and a legitimate `multi_get` whose answer exceeded the reply cap killed the connection instead of
answering. Both are measured here against the daemon process itself (its peak RSS, VmHWM).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest

from flodld.net.blocking import BlockingChannel
from flodld.rank.store import ControllerStore, StoreRequestError
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt
from flodld.wire.store import StoreError, StoreHello, StoreMultiGet, StoreOk, StoreValues

MIB = 1024 * 1024
RUN_ID = "store-limits"
_LISTENING = re.compile(r"event=listening bind=\S+ port=(\d+)")

pytestmark = pytest.mark.multiproc


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    port: int
    salt: bytes

    def peak_rss(self) -> int:
        """The daemon's high-water resident set, bytes."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/PID/status")

    def store(self) -> ControllerStore:
        return ControllerStore("127.0.0.1", self.port, self.salt, RUN_ID, timeout=timedelta(seconds=20))


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc to read the daemon's resident set")
    salt = new_salt()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flodld",
                "serve",
                "--once",
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--run-id",
                RUN_ID,
                "--ranks",
                "2",
                "--token",
                salt.hex(),
                "--window",
                "600",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            port = None
            while port is None:
                assert proc.poll() is None, "the daemon exited before listening"
                assert time.monotonic() < deadline, "the daemon did not listen within 30 s"
                log.seek(0)
                found = _LISTENING.search(log.read().decode(errors="replace"))
                if found:
                    port = int(found.group(1))
                else:
                    time.sleep(0.05)
            yield Daemon(proc, port, salt)
            assert proc.poll() is None, "the daemon died"
        finally:
            proc.kill()
            proc.wait(10)


def test_multi_get_naming_one_big_key_many_times_is_refused_before_any_copy(daemon: Daemon) -> None:
    store = daemon.store()
    store.set("big", os.urandom(20 * MIB))
    store.get("big")  # the daemon has now held, received and sent the value once
    baseline = daemon.peak_rss()

    # A raw client: ControllerStore itself never sends a key twice.
    channel = BlockingChannel.connect("127.0.0.1", daemon.port, Channel.RENDEZVOUS, daemon.salt, timeout=10)
    try:
        channel.send(StoreHello(run_id=RUN_ID))
        assert isinstance(channel.recv(10).message(), StoreOk)
        request = StoreMultiGet(keys=["big"] * 12, timeout=1.0)
        channel.send(request)
        reply = channel.recv(30).message()  # on the unfixed daemon: 240 MiB joined, then the link dropped
        assert isinstance(reply, StoreError) and reply.code == "duplicate_key", reply
        assert "big" in reply.reason
        # The same connection keeps serving.
        channel.send(StoreMultiGet(keys=["big"], timeout=1.0))
        frame = channel.recv(30)
        assert isinstance(frame.message(), StoreValues) and len(frame.tail) == 20 * MIB
    finally:
        channel.close()

    grown = daemon.peak_rss() - baseline
    assert grown < 48 * MIB, f"the daemon's peak RSS grew by {grown / MIB:.0f} MiB"
    assert store.get("big")[:0] == b""  # still serving other clients
    store.close()


def test_multi_get_over_the_reply_cap_gets_a_typed_too_large_error(daemon: Daemon) -> None:
    store = daemon.store()
    first, second = os.urandom(40 * MIB), os.urandom(40 * MIB)  # each under the 64 MiB cap, together over it
    store.set("a", first)
    store.set("b", second)
    store.get("a")
    baseline = daemon.peak_rss()

    with pytest.raises(StoreRequestError, match="smaller groups") as caught:
        store.multi_get(["a", "b"])
    assert caught.value.code == "too_large"
    assert isinstance(caught.value, RuntimeError)  # torch's DistStoreError
    assert "multi_get of 2 keys" in str(caught.value) and "reply cap" in str(caught.value)

    grown = daemon.peak_rss() - baseline
    assert grown < 48 * MIB, f"the daemon's peak RSS grew by {grown / MIB:.0f} MiB"
    # The same connection answers the next request; within the cap, multi_get works.
    channel = store._channel
    assert store.multi_get(["b"]) == [second]
    assert store._channel is channel, "the connection was dropped and re-dialed"
    store.set("c", b"small")
    assert store.multi_get(["a", "c"]) == [first, b"small"]
    store.close()
