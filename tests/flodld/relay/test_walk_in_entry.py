"""A walk-in relay's entry bookkeeping (flodld/relay/entry.py): when a rank may say it is ready.

A rank says RankReady once, on a walk-in's relay, before its host's Entry; anything else is out of turn
and the relay closes that rank's leg (the rank cannot make its host enter early or twice).
"""

from __future__ import annotations

from flodld.relay.entry import WalkInEntry
from flodld.wire.data import Entry


def test_each_rank_of_a_walk_in_says_ready_once_before_the_entry() -> None:
    entry = WalkInEntry(True, [3, 4], set())
    assert entry.ready(3) is None
    assert entry.ready(4) is None
    assert entry.ready(3) == "twice"
    assert entry.enter(Entry(round=7, epoch=1, members=[0, 3, 4]), None) is None
    assert entry.ready(4) == "after its host entered"


def test_a_relay_of_the_formed_world_takes_no_ready() -> None:
    assert WalkInEntry(False, [0, 1], set()).ready(0) == "to a relay that did not walk in"
