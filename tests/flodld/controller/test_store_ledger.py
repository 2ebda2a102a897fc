"""RequestLedger: the controller's bounded record of each store client's last mutating request."""

from __future__ import annotations

import pytest

from flodld.controller.store import RequestLedger
from flodld.wire.store import StoreInt, StoreOk


def test_ledger_replays_the_last_reply_refuses_older_ids_and_stays_bounded() -> None:
    ledger = RequestLedger(max_clients=3, max_bytes=100)
    assert ledger.lookup("a", 1) is None
    ledger.remember("a", 1, StoreInt(value=4), b"")
    assert ledger.lookup("a", 1) == (StoreInt(value=4), b"")
    assert ledger.answered("a", 1) and not ledger.answered("a", 2) and not ledger.answered("b", 1)
    assert ledger.lookup("a", 2) is None
    ledger.remember("a", 2, StoreOk(), b"")
    with pytest.raises(Exception, match="older") as caught:
        ledger.lookup("a", 1)
    assert getattr(caught.value, "code", None) == "stale_request"
    for client in ("b", "c", "d"):  # a fourth client evicts the least recently used one
        ledger.remember(client, 1, StoreOk(), b"")
    assert len(ledger) == 3 and ledger.lookup("a", 2) is None
    ledger.remember("e", 1, StoreOk(), b"x" * 90)  # remembered tails are capped too
    ledger.remember("f", 1, StoreOk(), b"y" * 20)
    assert ledger.lookup("e", 1) is None and ledger.lookup("f", 1) == (StoreOk(), b"y" * 20)
    assert ledger._bytes <= 100
