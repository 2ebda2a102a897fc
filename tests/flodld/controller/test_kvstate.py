"""KeyValueState: byte accounting of keys, values and queues; per-value cap; torch's integer range."""

from __future__ import annotations

import pytest

from flodld.controller.kvstate import KeyValueState, NotAnInteger, StoreFull


def test_append_is_refused_before_the_joined_value_would_exceed_the_per_value_cap() -> None:
    state = KeyValueState(max_bytes=1000, max_value_bytes=10)
    state.append("k", b"x" * 6)
    with pytest.raises(StoreFull, match="per-value cap"):
        state.append("k", b"y" * 5)
    assert state.get("k") == b"x" * 6
    with pytest.raises(StoreFull, match="per-value cap"):
        state.multi_set([("a", b"1"), ("b", b"z" * 11)])
    assert state.get("a") is None  # nothing of a refused multi_set is stored


def test_queues_count_against_the_budget_and_give_it_back_when_popped() -> None:
    state = KeyValueState(max_bytes=20)
    state.queue_push("q", b"12345")
    state.queue_push("q", b"67890")  # 1 (key) + 10 bytes
    with pytest.raises(StoreFull, match="budget"):
        state.queue_push("q", b"x" * 10)
    assert state.present("q") and not state.has_value("q") and state.num_keys() == 0
    assert state.queue_pop("q") == b"12345"
    assert state.queue_pop("q") == b"67890"
    assert state.queue_pop("q") is None and not state.present("q")
    state.set("k", b"x" * 19)  # the whole budget is free again


def test_add_stays_in_torchs_signed_64_bit_range() -> None:
    state = KeyValueState()
    assert state.add("n", 2**63 - 1) == 2**63 - 1
    with pytest.raises(NotAnInteger, match="64-bit"):
        state.add("n", 1)
    assert state.get("n") == str(2**63 - 1).encode()
