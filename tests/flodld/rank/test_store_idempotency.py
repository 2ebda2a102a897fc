"""A mutating store request re-sent after a lost reply is applied once (issue 13 point 14).

`ControllerStore` re-dials once and re-sends when its connection breaks. When the break comes after the
controller applied the request but before the reply was read, the re-send used to apply it a second
time: `add` counted twice, `append` appended twice, `compare_set` swapped again. The proxy below loses
exactly that reply and resets the connection; the controller must answer the re-send from its record.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from flodld.rank.store import ControllerStore

from .conftest import ResettingProxy, StoreServer


def _through(proxy: ResettingProxy, server: StoreServer) -> ControllerStore:
    return ControllerStore("127.0.0.1", proxy.port, server.salt, server.run_id, timeout=timedelta(seconds=10))


def _direct(server: StoreServer) -> ControllerStore:
    return ControllerStore(
        "127.0.0.1", server.port, server.salt, server.run_id, timeout=timedelta(seconds=10)
    )


def test_add_whose_reply_was_lost_counts_once(
    store_server: StoreServer, resetting_proxy: ResettingProxy
) -> None:
    store = _through(resetting_proxy, store_server)
    assert store.add("n", 5) == 5
    resetting_proxy.cut_next_reply()
    assert store.add("n", 1) == 6  # applied, reply lost, connection reset, re-sent on a new connection
    assert resetting_proxy.cuts == 1 and resetting_proxy.connections == 2
    assert _direct(store_server).get("n") == b"6"
    assert store.add("n", 1) == 7  # the next request is a new one
    store.close()


def test_append_whose_reply_was_lost_appends_once(
    store_server: StoreServer, resetting_proxy: ResettingProxy
) -> None:
    store = _through(resetting_proxy, store_server)
    store.append("log", b"a")
    resetting_proxy.cut_next_reply()
    store.append("log", b"b")
    assert resetting_proxy.cuts == 1 and resetting_proxy.connections == 2
    assert store.get("log") == b"ab"
    store.close()


def test_compare_set_whose_reply_was_lost_swaps_once(
    store_server: StoreServer, resetting_proxy: ResettingProxy
) -> None:
    store = _through(resetting_proxy, store_server)
    other = _direct(store_server)
    other.set("lock", b"free")
    # Our swap takes the lock; before we learn it, another client sets the lock free again. The re-sent
    # swap must not take it a second time (it would overwrite what the other client did after us).
    resetting_proxy.cut_next_reply(hook=lambda: other.set("lock", b"free"))
    assert store.compare_set("lock", b"free", b"ours") == b"ours"  # the answer to the first application
    assert resetting_proxy.cuts == 1 and resetting_proxy.connections == 2
    assert other.get("lock") == b"free"
    other.close()
    store.close()


def test_queue_pop_whose_reply_was_lost_pops_once(
    store_server: StoreServer, resetting_proxy: ResettingProxy
) -> None:
    store = _through(resetting_proxy, store_server)
    for item in (b"1", b"2"):
        store.queue_push("q", item)
    resetting_proxy.cut_next_reply()
    assert store.queue_pop("q") == b"1"
    assert store.queue_len("q") == 1
    assert store.queue_pop("q") == b"2"
    store.close()


def test_each_clone_is_its_own_client(store_server: StoreServer) -> None:
    store = _direct(store_server)
    clone = store.clone()
    assert store.add("c", 1) == 1
    assert clone.add("c", 1) == 2  # same request id 1 from another client: applied, not replayed
    assert store.add("c", 1) == 3
    clone.close()
    store.close()


def test_a_blocking_queue_pop_re_sent_after_a_reset_gets_the_item(
    store_server: StoreServer, resetting_proxy: ResettingProxy
) -> None:
    """The original pop stays parked on the controller after its connection died; the item pushed later
    must reach the re-sent pop, not vanish into the dead connection.
    """
    store = _through(resetting_proxy, store_server)
    got: list[bytes] = []
    popper = threading.Thread(target=lambda: got.append(store.queue_pop("jobs")))
    popper.start()
    time.sleep(0.5)  # the pop is parked on the controller
    resetting_proxy.reset_all()
    time.sleep(0.5)  # the client re-dialed and re-sent the pop, which parks beside the first
    pusher = _direct(store_server)
    pusher.queue_push("jobs", b"only")
    popper.join(15)
    assert got == [b"only"]
    assert resetting_proxy.connections == 2
    pusher.close()
    store.close()
