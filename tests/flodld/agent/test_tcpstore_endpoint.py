"""The agent's loopback TCPStore endpoint (flodld.agent.tcpstore) in front of the real controller store:
torch's own TCPStore client (in a subprocess, as a rank would be) gets torch's answers, what it stores
lands in the controller's authenticated store, and a connection from another uid is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest

from flodld.agent.tcpstore import AgentStoreEndpoint, ControllerAddress
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.store import StoreService
from flodld.net.peeruid import socket_owner_uid
from flodld.rank.store import ControllerStore
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt

pytestmark = pytest.mark.multiproc


@dataclass
class Served:
    store_port: int
    endpoint_port: int
    salt: bytes
    endpoint: AgentStoreEndpoint
    loop: asyncio.AbstractEventLoop


def _serve(uid: int | None = None) -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    salt = new_salt()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    said: list[str] = []

    async def main() -> tuple[PortMux, AgentStoreEndpoint, int, int]:
        counters = ControllerCounters()
        service = StoreService("run-1", salt, counters)
        mux = PortMux(counters)
        mux.register(Channel.RENDEZVOUS, service.handle)
        _, port = await mux.start("127.0.0.1", 0)
        endpoint = AgentStoreEndpoint(
            ControllerAddress("127.0.0.1", port, salt, "run-1"), say=said.append, uid=uid
        )
        return mux, endpoint, port, await endpoint.start()

    mux, endpoint, port, endpoint_port = asyncio.run_coroutine_threadsafe(main(), loop).result(10)
    yield Served(port, endpoint_port, salt, endpoint, loop)
    asyncio.run_coroutine_threadsafe(endpoint.close(), loop).result(10)
    asyncio.run_coroutine_threadsafe(mux.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def served() -> Iterator[Served]:
    yield from _serve()


_CLIENT = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch.distributed as dist

    c = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timedelta(seconds=20))
    out = {}
    def op(name, f):
        try:
            value = f()
            out[name] = value.decode() if isinstance(value, bytes) else value
        except Exception as error:
            out[name] = f"{type(error).__name__}: {error}"
    op("set", lambda: c.set("k", b"v1"))
    op("get", lambda: c.get("k"))
    op("add", lambda: c.add("n", 5))
    op("add2", lambda: c.add("n", -2))
    op("cas", lambda: c.compare_set("k", b"v1", b"v2"))
    op("cas_miss", lambda: c.compare_set("zz", b"x", b"y"))
    op("cas_empty", lambda: c.compare_set("zz", b"", b"y"))
    op("check", lambda: [c.check(["k"]), c.check(["k", "nope"])])
    op("wait", lambda: c.wait(["k"]))
    op("delete", lambda: [c.delete_key("n"), c.delete_key("n")])
    op("append", lambda: (c.append("k", b"++"), c.get("k"))[1])
    op("multi_get", lambda: [v.decode() for v in c.multi_get(["k", "zz", "k"])])
    op(
        "multi_set",
        lambda: (c.multi_set(["a", "b"], [b"1", b"22"]), [c.get("a").decode(), c.get("b").decode()])[1],
    )
    op("queue", lambda: (c.queue_push("q", b"qq"), c.queue_push("q", b"q2"), c.queue_len("q"))[2])
    op("pop", lambda: [c.queue_pop("q").decode(), c.queue_pop("q", block=False).decode()])
    op("pop_empty", lambda: c.queue_pop("q", block=False))
    op("list_keys", lambda: sorted(c.list_keys()))
    op("num_keys", lambda: c.num_keys())
    op("wait_timeout", lambda: c.wait(["never"], timedelta(milliseconds=300)))
    op("after_timeout", lambda: c.get("k"))
    op("clone", lambda: c.clone().get("a"))
    op("late", lambda: c.get("from_controller"))
    print(json.dumps(out, default=str), flush=True)
    """
)


def test_torchs_tcpstore_client_gets_torchs_answers_from_the_controller_store(served: Served) -> None:
    # A flodld rank (ControllerStore) sets a key only after the TCPStore client has been waiting for it.
    def late_set() -> None:
        store = ControllerStore(
            "127.0.0.1", served.store_port, served.salt, "run-1", timeout=timedelta(seconds=30)
        )
        store.set("/from_controller", b"hello")
        store.close()

    timer = threading.Timer(6.0, late_set)
    timer.start()
    result = subprocess.run(
        [sys.executable, "-c", _CLIENT, str(served.endpoint_port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    timer.join()
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["set"] is None and out["get"] == "v1"
    assert (out["add"], out["add2"]) == (5, 3)
    assert (out["cas"], out["cas_miss"], out["cas_empty"]) == ("v2", "x", "y")
    assert out["check"] == [True, False] and out["wait"] is None
    assert out["delete"] == [True, False]
    assert out["append"] == "v2++"
    assert out["multi_get"] == ["v2++", "y", "v2++"]
    assert out["multi_set"] == ["1", "22"]
    assert out["queue"] == 2 and out["pop"] == ["qq", "q2"]
    assert out["pop_empty"].startswith("QueueEmptyError")
    assert out["list_keys"] == ["a", "b", "k", "zz"]
    assert isinstance(out["num_keys"], int) and out["num_keys"] >= 5
    assert out["wait_timeout"].startswith("DistStoreError") and "300ms" in out["wait_timeout"]
    assert out["after_timeout"] == "v2++"  # the connection is still good after a canceled wait
    assert out["clone"] == "1"
    assert out["late"] == "hello"
    # What the client stored is in the controller's authenticated store (torch prefixes its keys with '/').
    store = ControllerStore(
        "127.0.0.1", served.store_port, served.salt, "run-1", timeout=timedelta(seconds=10)
    )
    try:
        assert store.get("/k") == b"v2++" and store.get("init/") == b"1"
    finally:
        store.close()


_RAW_CLIENT = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    s.sendall(bytes.fromhex("00cef7853c" "0d5d3f0000"))  # VALIDATE, PING
    try:
        reply = s.recv(16)
    except ConnectionResetError:
        reply = b""
    print("reply=" + reply.hex(), flush=True)
    """
)


def _raw_ping(port: int) -> subprocess.CompletedProcess[str]:
    """The raw client (VALIDATE, PING) against PORT as a process of this uid; stdout: `reply=<hex>`."""
    return subprocess.run(
        [sys.executable, "-c", _RAW_CLIENT, str(port)], capture_output=True, text=True, timeout=60
    )


def test_a_same_uid_peer_gets_its_ping_answered(served: Served) -> None:
    result = _raw_ping(served.endpoint_port)
    assert "reply=5d3f0000" in result.stdout, result.stdout + result.stderr
    assert served.endpoint.refused == 0


def test_a_peer_of_another_uid_is_closed_before_a_byte_is_read() -> None:
    # The endpoint is told it serves some other uid: this test's own (real) connection then comes from
    # "another uid", and is refused on the uid found in /proc/net/tcp.
    for served in _serve(uid=os.getuid() + 4242):
        result = _raw_ping(served.endpoint_port)
        assert "reply=\n" in result.stdout or result.stdout.strip() == "reply=", result.stdout + result.stderr
        assert served.endpoint.refused == 1


_SYSTEM_PYTHON = "/usr/bin/python3"  # the test user cannot run root's interpreter under /root


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(_SYSTEM_PYTHON, os.X_OK),
    reason="needs root, setpriv and /usr/bin/python3 to be another uid",
)
def test_a_connection_from_another_real_uid_is_refused(served: Served) -> None:
    from tests.flodld.fanout.joinuser import as_join_user, join_user

    user = join_user()
    result = subprocess.run(
        as_join_user([_SYSTEM_PYTHON, "-c", _RAW_CLIENT, str(served.endpoint_port)], user),
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "reply=", result.stdout
    assert served.endpoint.refused == 1
    # ... while the same client as this uid is served.
    ours = _raw_ping(served.endpoint_port)
    assert "reply=5d3f0000" in ours.stdout


def test_socket_owner_uid_finds_the_peer_socket_of_a_loopback_connection() -> None:
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, peer = listener.accept()
    try:
        assert socket_owner_uid(peer, server_side.getsockname()) == os.getuid()
        assert socket_owner_uid(("127.0.0.1", 1), server_side.getsockname()) is None
    finally:
        for sock in (client, server_side, listener):
            sock.close()


def test_a_web_page_posting_to_the_endpoint_is_dropped_and_the_next_client_is_served(served: Served) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", served.endpoint_port), timeout=10) as sock:
        sock.sendall(b"POST /store HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\nhi")
        assert sock.recv(64) == b""  # closed without a byte: the first request must be torch's VALIDATE
    result = _raw_ping(served.endpoint_port)
    assert "reply=5d3f0000" in result.stdout, result.stdout + result.stderr


def test_agents_work_out_their_node_rank_in_the_store_in_rank_order(served: Served) -> None:
    from flodld.agent.tcpstore import node_rank

    address = ControllerAddress("127.0.0.1", served.store_port, served.salt, "run-1")

    async def hosts() -> list[tuple[int, int]]:
        # Three hosts holding ranks [0, 1], [2, 3, 4], [5], publishing in any order.
        return list(await asyncio.gather(
            node_rank(address, first_rank=5, local_size=1, world_size=6),
            node_rank(address, first_rank=0, local_size=2, world_size=6),
            node_rank(address, first_rank=2, local_size=3, world_size=6),
        ))  # fmt: skip

    assert asyncio.run_coroutine_threadsafe(hosts(), served.loop).result(30) == [(2, 3), (0, 3), (1, 3)]


def test_a_host_that_never_publishes_makes_node_rank_time_out(served: Served) -> None:
    from flodld.agent.tcpstore import node_rank

    address = ControllerAddress("127.0.0.1", served.store_port, served.salt, "run-1")
    lonely = node_rank(address, first_rank=0, local_size=2, world_size=4, timeout=1.0)
    with pytest.raises(TimeoutError):
        asyncio.run_coroutine_threadsafe(lonely, served.loop).result(30)


# PyTorch's own store tests for queues and long keys (test/distributed/test_store.py: test_queues,
# test_queues_nonblocking, test_queues_bidirectional, test_queues_timeout; a key as long as torch's default
# TCPStore server takes), restated in torch's TCPStore client against the endpoint. Each test gets its own
# namespace (a PrefixStore), as torch's get a fresh store.
_TORCH_STORE_TESTS = textwrap.dedent(
    """
    import itertools, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta
    import torch.distributed as dist

    port, names = int(sys.argv[1]), itertools.count()

    def fresh():
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
        return dist.PrefixStore(f"t{next(names)}", client)

    def test_queues(store):
        assert not store.check(["foo"]) and store.queue_len("foo") == 0
        store.queue_push("foo", "1")
        store.queue_push("foo", "2")
        assert store.check(["foo"]) and store.queue_len("foo") == 2
        store.wait(["foo"])
        assert store.queue_pop("foo") == b"1" and store.queue_pop("foo") == b"2"
        assert not store.check(["foo"]) and store.queue_len("foo") == 0

    def test_queues_nonblocking(store):
        try:
            store.queue_pop("foo", block=False)
            raise AssertionError("no QueueEmptyError")
        except dist.QueueEmptyError as error:
            assert "empty" in str(error)
        store.queue_push("foo", "a")
        assert store.queue_pop("foo", block=False) == b"a"

    def test_queues_bidirectional(store):
        def worker_a():
            local = store.clone()
            local.queue_push("a", "a1")
            assert local.queue_pop("b") == b"b1"

        def worker_b():
            local = store.clone()
            assert local.queue_pop("a") == b"a1"
            local.queue_push("b", "b1")

        with ThreadPoolExecutor(max_workers=2) as pool:
            for future in [pool.submit(worker_a), pool.submit(worker_b)]:
                future.result(timeout=60)

    def test_queues_timeout(store):
        store.set_timeout(timedelta(seconds=0.01))
        try:
            store.queue_pop("non_existant")
            raise AssertionError("no timeout")
        except dist.DistStoreError as error:
            assert "timeout" in str(error)

    def test_long_keys(store):
        for length in (2048, 8000):
            key = "k" * length
            store.set(key, "v")
            assert store.get(key) == b"v" and store.check([key])
            store.queue_push(key, "q")
            assert store.queue_pop(key) == b"q"

    def test_queue_pop_of_a_key_pushed_later(store):
        assert store.queue_pop("later") == b"x"  # the test process pushes it after several wait slices

    def test_two_blocked_consumers_get_one_item_each(store):
        # As torch's own server: the first push ends both WAITs, and the consumer that finds the queue
        # empty again keeps waiting for the second item instead of raising QueueEmptyError.
        got = []

        def consume():
            try:
                got.append(store.clone().queue_pop("q"))
            except Exception as error:
                got.append(f"{type(error).__name__}: {error}")

        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(consume), pool.submit(consume)]
            time.sleep(1.0)
            store.queue_push("q", "1")
            time.sleep(1.0)
            store.queue_push("q", "2")
            for future in futures:
                future.result(timeout=60)
        assert sorted(got, key=repr) == [b"1", b"2"], got

    for test in (test_queues, test_queues_nonblocking, test_queues_bidirectional, test_queues_timeout,
                 test_long_keys, test_queue_pop_of_a_key_pushed_later,
                 test_two_blocked_consumers_get_one_item_each):
        test(fresh())
        print(test.__name__, "ok", flush=True)
    """
)


def test_torchs_queue_and_long_key_store_tests_pass_against_the_endpoint(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flodld.agent.tcpstore as endpoint_module

    monkeypatch.setattr(endpoint_module, "WAIT_SLICE_SECS", 0.2)  # the late pop spans several slices
    pushed = threading.Event()

    def push_later(process: subprocess.Popen[str]) -> None:
        store = ControllerStore(
            "127.0.0.1", served.store_port, served.salt, "run-1", timeout=timedelta(seconds=30)
        )
        try:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.strip())
                if line.startswith("test_long_keys ok"):
                    time.sleep(1.0)  # the pop is parked by now, over several 0.2 s slices
                    store.queue_push("/t5/later", "x")  # torch's client prefixes '/', PrefixStore 't5/'
                    pushed.set()
        finally:
            store.close()

    lines: list[str] = []
    process = subprocess.Popen(
        [sys.executable, "-c", _TORCH_STORE_TESTS, str(served.endpoint_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    reader = threading.Thread(target=push_later, args=(process,), daemon=True)
    reader.start()
    try:
        code = process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    assert process.stderr is not None
    assert code == 0, (lines, process.stderr.read()[-4000:])
    assert pushed.is_set()
    assert lines == [
        f"{name} ok"
        for name in (
            "test_queues", "test_queues_nonblocking", "test_queues_bidirectional", "test_queues_timeout",
            "test_long_keys", "test_queue_pop_of_a_key_pushed_later",
            "test_two_blocked_consumers_get_one_item_each",
        )
    ]  # fmt: skip
