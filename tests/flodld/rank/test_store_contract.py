"""`ControllerStore` honours torch's Store contract: PyTorch's own store-test assertions
(test/distributed/test_store.py), restated against the real store service on a loopback mux, plus
torch's C++-trampoline check `torch.distributed._test_python_store`.
"""

from __future__ import annotations

import gc
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol, cast

import pytest
import torch.distributed as dist

# torch.distributed re-exports these without `as`, which mypy does not count as exported; this is where
# they are defined (the same class objects: `dist.Store is Store`).
from torch._C._distributed_c10d import PrefixStore, Store

from flodld.rank.store import ControllerStore, StoreRequestError
from flodld.wire.store import MAX_KEY_CHARS

from .conftest import StoreServer

TORCH_STORE_METHODS = [
    "add", "append", "barrier", "check", "clone", "compare_set", "delete_key", "get", "has_extended_api",
    "list_keys", "multi_get", "multi_set", "num_keys", "queue_len", "queue_pop", "queue_push", "set",
    "set_timeout", "timeout", "wait",
]


class TorchStore(Protocol):
    """The parts of torch 2.13's Store that its type stub (torch/_C/_distributed_c10d.pyi) leaves out."""

    @property
    def timeout(self) -> timedelta: ...

    def append(self, key: str, value: str) -> None: ...

    def multi_set(self, keys: list[str], values: list[str]) -> None: ...

    def clone(self) -> Store: ...


@pytest.fixture
def store(store_server: StoreServer) -> Iterator[ControllerStore]:
    client = ControllerStore("127.0.0.1", store_server.port, store_server.salt, store_server.run_id,
                             timeout=timedelta(seconds=300))
    yield client
    client.close()


def test_every_method_of_torch_store_is_overridden() -> None:
    # Whatever this torch's Store has (a newer torch adding a method fails here until we implement it).
    public = {name for name in dir(Store) if not name.startswith("_")}
    assert public <= set(TORCH_STORE_METHODS), public - set(TORCH_STORE_METHODS)
    for name in sorted(public - {"timeout"}):  # `timeout`: the base's property, kept in sync by set_timeout
        assert getattr(ControllerStore, name) is not getattr(Store, name), name
    assert issubclass(ControllerStore, Store)


def test_set_get_check(store: ControllerStore) -> None:
    for amount in (1, 2, 3):
        store.add("key", amount)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    store.add("key3", 2)
    store.set("key2", "value2")
    for amount in (3, 4, 5, 6):
        store.add("key3", amount)
    assert store.num_keys() == 5
    assert store.get("key") == b"6"
    assert store.get("key0") == b"value0"
    assert store.get("key1") == b"value1"
    assert store.get("key2") == b"value2"
    assert store.get("key3") == b"21"
    assert store.check(["key3"])
    assert not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    store.delete_key("-key3")
    assert store.num_keys() == 5


def test_compare_set(store: ControllerStore) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    store.set("cs_key0", "value0")
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_simple_wait_times_out_with_dist_store_error_naming_the_timeout(store: ControllerStore) -> None:
    with pytest.raises(dist.DistStoreError, match=r"[t -i]imeout") as caught:
        store.wait(["bad_key"], timedelta(seconds=0.25))
    assert isinstance(caught.value, RuntimeError)
    assert "250ms" in str(caught.value) and "bad_key" in str(caught.value)
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_numkeys_delkeys_and_get_timeout(store: ControllerStore) -> None:
    store.add("key", 1)
    store.add("key", 2)
    store.add("key", 3)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    assert store.num_keys() == 4
    assert store.delete_key("key") is True
    assert store.num_keys() == 3
    store.set_timeout(timedelta(seconds=0.1))
    assert cast(TorchStore, store).timeout == timedelta(seconds=0.1)  # the base's property
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 100ms, keys: \\['key'\\]"):
        store.get("key")
    assert time.monotonic() - started < 5
    store.delete_key("key0")
    store.delete_key("key3")
    assert store.num_keys() == 1
    store.set("key4", "value2")
    assert store.num_keys() == 2
    assert store.get("key1") == b"value1"
    assert store.get("key4") == b"value2"


def test_append_multi_set_multi_get(store: ControllerStore) -> None:
    assert store.has_extended_api()
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", "tato")
    assert store.get("foo") == b"potato"
    assert store.get("bar") == b"potato"
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert store.get("foo") == b"po"
    assert store.get("bar") == b"tato"
    v0, v1 = store.multi_get(["foo", "bar"])
    assert (v0, v1) == (b"po", b"tato")
    # torch allows a key twice in multi_get; the client asks the controller once and repeats it.
    assert store.multi_get(["foo", "bar", "foo"]) == [b"po", b"tato", b"po"]


def test_list_keys(store: ControllerStore) -> None:
    assert store.list_keys() == []
    store.set("a", "1")
    store.add("b/c", 2)
    store.queue_push("q", "x")  # queues are not keys
    assert store.list_keys() == ["a", "b/c"]


def test_queues(store: ControllerStore) -> None:
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.check(["foo"])
    assert store.queue_len("foo") == 2
    store.wait(["foo"])
    assert store.queue_pop("foo") == b"1"
    assert store.queue_pop("foo") == b"2"
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0


def test_queues_nonblocking(store: ControllerStore) -> None:
    with pytest.raises(dist.QueueEmptyError, match="empty"):
        store.queue_pop("foo", block=False)
    store.queue_push("foo", "a")
    assert store.queue_pop("foo", block=False) == b"a"


def test_queues_bidirectional(store: ControllerStore) -> None:
    def worker_a() -> None:
        local = store.clone()
        local.queue_push("a", "a1")
        assert local.queue_pop("b") == b"b1"
        local.close()

    def worker_b() -> None:
        local = store.clone()
        assert local.queue_pop("a") == b"a1"
        local.queue_push("b", "b1")
        local.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(worker_a), pool.submit(worker_b)]:
            future.result(timeout=30)


def test_queues_timeout(store: ControllerStore) -> None:
    store.set_timeout(timedelta(seconds=0.01))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.queue_pop("non_existant")


@pytest.mark.parametrize("length", [2048, MAX_KEY_CHARS])
def test_a_key_as_long_as_torchs_tcpstore_accepts_works_for_every_kind_of_request(
    store: ControllerStore, length: int
) -> None:
    # torch's TCPStore (default libuv server) takes keys up to 8191 bytes; a 2 KiB key was refused (issue 30).
    key = "k" * (length - 1) + "/"
    store.set(key, "v")
    assert store.get(key) == b"v" and store.check([key])
    assert store.add(key[:-1] + "n", 2) == 2
    store.append(key, "w")
    assert store.multi_get([key]) == [b"vw"]
    store.queue_push(key, "q")
    assert store.queue_pop(key) == b"q"
    store.wait([key])
    assert store.delete_key(key)


def test_a_key_over_the_cap_is_refused_before_it_is_sent(store: ControllerStore) -> None:
    with pytest.raises(ValueError, match="at most 8191 characters"):
        store.set("k" * (MAX_KEY_CHARS + 1), "v")
    assert store.num_keys() == 0  # the connection still serves


def test_a_blocking_queue_pop_returns_an_item_pushed_later_by_another_client(store: ControllerStore) -> None:
    popped: list[bytes] = []
    waiter = threading.Thread(target=lambda: popped.append(store.queue_pop("later")))
    waiter.start()
    pusher = store.clone()
    time.sleep(0.3)  # the pop parks on the controller first (were the push first, the test still passes)
    pusher.queue_push("later", "x")
    waiter.join(30)
    pusher.close()
    assert popped == [b"x"]


def test_two_blocked_consumers_get_one_item_each(store: ControllerStore) -> None:
    got: list[bytes] = []

    def consume() -> None:
        local = store.clone()
        got.append(local.queue_pop("q"))
        local.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(consume), pool.submit(consume)]
        time.sleep(0.3)
        store.queue_push("q", "1")
        time.sleep(0.3)
        store.queue_push("q", "2")
        for future in futures:
            future.result(timeout=30)
    assert sorted(got) == [b"1", b"2"]


def test_clone_is_an_independent_connection_to_the_same_store(store: ControllerStore) -> None:
    clone = store.clone()
    assert isinstance(clone, Store) and clone is not store
    assert clone.client_id != store.client_id
    store.set("foo", "bar")
    assert clone.get("foo") == b"bar"
    store.close()  # the clone keeps working on its own connection
    assert clone.add("n", 2) == 2
    clone.close()


def test_barrier_releases_when_world_size_callers_arrived(store: ControllerStore) -> None:
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.barrier("b0", 2, timedelta(seconds=0.2))  # one of two arrived
    other = store.clone()
    other.barrier("b0", 2, timedelta(seconds=5))  # the second arrival releases both
    store.barrier("solo", 1)
    errors: list[BaseException] = []

    def arrive(client: ControllerStore) -> None:
        try:
            client.barrier("b1", 3, timedelta(seconds=10))
        except BaseException as error:  # reported below
            errors.append(error)

    clones = [store.clone() for _ in range(3)]
    threads = [threading.Thread(target=arrive, args=(c,)) for c in clones]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors
    assert store.get("b1/num_members") == b"3"
    for client in [other, *clones]:
        client.close()


def test_torch_python_store_check_through_the_cpp_trampoline(store: ControllerStore) -> None:
    dist._test_python_store(store)  # type: ignore[attr-defined]


def test_prefix_store_over_it_reaches_every_method_from_cpp(store: ControllerStore) -> None:
    prefixed = PrefixStore("p", store)
    prefixed.set("k", "v")
    assert store.get("p/k") == b"v"
    assert prefixed.add("n", 5) == 5
    assert prefixed.compare_set("k", "v", "w") == b"w"
    assert prefixed.check(["k"]) and not prefixed.check(["absent"])
    assert prefixed.num_keys() == 2  # C++ calls getNumKeys on the Python store
    assert prefixed.delete_key("n")
    cast(TorchStore, prefixed).append("k", "x")
    cast(TorchStore, prefixed).multi_set(["m1", "m2"], ["1", "2"])
    assert prefixed.multi_get(["k", "m1"]) == [b"wx", b"1"]
    with pytest.raises(RuntimeError, match="timeout"):
        prefixed.wait(["never"], timedelta(seconds=0.1))


def test_a_store_handed_only_to_torch_survives_garbage_collection(store_server: StoreServer) -> None:
    prefixed = PrefixStore(
        "gc", ControllerStore("127.0.0.1", store_server.port, store_server.salt, store_server.run_id,
                              timeout=timedelta(seconds=10))
    )
    clone = cast(TorchStore, prefixed).clone()  # torch's C++ clone: the Python clone is held only by C++
    gc.collect()
    prefixed.set("k", "v")
    assert clone.get("k") == b"v"  # the clone is a PrefixStore("gc") over a clone of ours
    assert store_server.service.state.get("gc/k") == b"v"


_SUBGROUP_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from datetime import timedelta
    from flodld.rank.store import ControllerStore
    torch.set_num_threads(1)
    port, salt_hex, rank, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def init():  # the store object goes out of scope: only torch holds it afterwards
        store = ControllerStore("127.0.0.1", port, bytes.fromhex(salt_hex), "run-1", rank=rank,
                                timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))

    init()
    group = dist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        print(f"SUBGROUP {t.item():g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.multiproc
def test_gloo_new_group_over_controller_store(store_server: StoreServer) -> None:
    procs = store_server.start_ranks(_SUBGROUP_SCRIPT, 3)
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outputs.append(out)
    assert ["SUBGROUP 3" in out for out in outputs] == [True, True, False]


def test_refusals_are_dist_store_errors_with_their_code(store: ControllerStore) -> None:
    store.set("text", "abc")
    with pytest.raises(dist.DistStoreError) as caught:
        store.add("text", 1)
    assert isinstance(caught.value, StoreRequestError) and caught.value.code == "not_integer"
