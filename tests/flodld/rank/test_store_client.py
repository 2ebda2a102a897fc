"""ControllerStore against the real store service on a loopback mux, including gloo process groups."""

from __future__ import annotations

import textwrap
import threading
from datetime import timedelta

import pytest

from flodld.net.blocking import BlockingChannel
from flodld.rank.store import ControllerStore, StoreRequestError
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt
from flodld.wire.store import StoreError, StoreGet, StoreHello, StoreInt, StoreOk, StoreSet, StoreValue

from .conftest import StoreServer


def _client(server: StoreServer, **kwargs: object) -> ControllerStore:
    return ControllerStore("127.0.0.1", server.port, server.salt, server.run_id, **kwargs)  # type: ignore[arg-type]


def test_every_store_method_follows_torch_semantics(store_server: StoreServer) -> None:
    store = _client(store_server, timeout=timedelta(seconds=2))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("counter", 3) == 3
    assert store.add("counter", -1) == 2
    assert store.get("counter") == b"2"
    assert store.compare_set("cas", b"", b"first") == b"first"
    assert store.compare_set("cas", b"wrong", b"second") == b"first"
    assert store.compare_set("cas", b"first", b"second") == b"second"
    assert store.compare_set("absent", b"x", b"y") == b"x"
    assert store.check(["a", "counter"]) is True
    assert store.check(["a", "nope"]) is False
    store.multi_set(["m1", "m2"], [b"one", b""])
    assert store.multi_get(["m1", "m2", "a"]) == [b"one", b"", b"1"]
    store.append("log", b"ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"
    keys_before = store.num_keys()
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == keys_before - 1
    store.wait(["m1", "log"])
    store.close()


def test_get_blocks_until_another_client_sets_the_key(store_server: StoreServer) -> None:
    waiter = _client(store_server, timeout=timedelta(seconds=5))
    setter = _client(store_server)
    result: list[bytes] = []
    thread = threading.Thread(target=lambda: result.append(waiter.get("late")))
    thread.start()
    setter.set("late", b"here")
    thread.join(5)
    assert result == [b"here"]


def test_wait_times_out_with_a_timeout_error_and_the_connection_survives(store_server: StoreServer) -> None:
    store = _client(store_server)
    with pytest.raises(TimeoutError, match="never"):
        store.wait(["never"], timedelta(seconds=0.2))
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(TimeoutError):
        store.get("never")
    store.set("after", b"ok")
    assert store.get("after") == b"ok"


def test_add_on_a_non_integer_names_the_key(store_server: StoreServer) -> None:
    store = _client(store_server)
    store.set("text", b"abc")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        store.add("text", 1)


def test_wrong_salt_gets_no_answer_and_wrong_run_is_refused(store_server: StoreServer) -> None:
    with pytest.raises((EOFError, ConnectionError, TimeoutError)):
        ControllerStore("127.0.0.1", store_server.port, new_salt(), "run-1", connect_timeout=2)
    with pytest.raises(StoreRequestError, match="wrong_run"):
        ControllerStore("127.0.0.1", store_server.port, store_server.salt, "other-run")


def test_a_dropped_connection_is_redialed_once(store_server: StoreServer) -> None:
    store = _client(store_server)
    store.set("k", b"v")
    assert store._channel is not None
    store._channel.sock.close()  # simulate a broken link under the client
    assert store.get("k") == b"v"


_RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from datetime import timedelta
    from flodld.rank.store import ControllerStore
    torch.set_num_threads(1)
    port, salt_hex, rank, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = ControllerStore("127.0.0.1", port, bytes.fromhex(salt_hex), "run-1", rank=rank,
                            timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"RESULT {t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_all_reduce_over_controller_store(store_server: StoreServer, world: int) -> None:
    procs = store_server.start_ranks(_RANK_SCRIPT, world)
    expected = sum(range(1, world + 1))
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-2000:]
        assert f"RESULT {expected}" in out
    assert store_server.service.state.num_keys() > 0


def test_a_message_that_is_no_store_request_is_refused_and_the_connection_keeps_serving(
    store_server: StoreServer,
) -> None:
    """A reply kind (or another channel's message) mid-session answers bad_request naming its class."""
    channel = BlockingChannel.connect(
        "127.0.0.1", store_server.port, Channel.RENDEZVOUS, store_server.salt, timeout=10
    )
    try:
        channel.send(StoreHello(run_id=store_server.run_id))
        assert isinstance(channel.recv(10).message(), StoreOk)
        for stray in (StoreInt(value=1), StoreHello(run_id=store_server.run_id)):
            channel.send(stray)
            reply = channel.recv(10).message()
            assert isinstance(reply, StoreError) and reply.code == "bad_request", reply
            assert reply.reason == f"{type(stray).__name__} is not a store request"
        channel.send(StoreSet(key="k"), b"v")
        assert isinstance(channel.recv(10).message(), StoreOk)
        channel.send(StoreGet(key="k", timeout=1.0))
        frame = channel.recv(10)
        assert isinstance(frame.message(), StoreValue) and frame.tail == b"v"
    finally:
        channel.close()
