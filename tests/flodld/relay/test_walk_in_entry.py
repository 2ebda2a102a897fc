"""A relay's entry bookkeeping (flodld/relay/entry.py): when a rank may say it is ready, and when a rider
enters.

A rank says RankReady once, on a walk-in's relay, before its host's Entry, or as a rider the controller
expects (RankExpected); anything else is out of turn and the relay closes that rank's leg (the rank cannot
make its host enter early or twice). A rider enters the relay's fold only at the boundary its Entry names.
"""

from __future__ import annotations

import torch

from flodld.fold.barrier import RoundBarrier
from flodld.relay.entry import WalkInEntry
from flodld.wire.data import Entry
from tests.flodld.fold.test_fold_chunks import chunks_of


def test_each_rank_of_a_walk_in_says_ready_once_before_the_entry() -> None:
    entry = WalkInEntry(True, [3, 4], set())
    assert entry.ready(3) is None
    assert entry.ready(4) is None
    assert entry.ready(3) == "twice"
    assert entry.enter(Entry(round=7, epoch=1, members=[0, 3, 4]), None) is None
    assert entry.ready(4) == "after its host entered"


def test_a_relay_of_the_formed_world_takes_no_ready() -> None:
    assert WalkInEntry(False, [0, 1], set()).ready(0) == "to a relay that did not walk in"


# --- riders: a healed slot's rank on a relay already in the averaging (docs/elastic-averaging.md) --------


def _relay_at_round_one() -> tuple[WalkInEntry, RoundBarrier[int]]:
    """A relay of the formed world (ranks 0 and 1) whose fold finished round 0, and rider 5 ready."""
    entry = WalkInEntry(False, [0, 1], set())
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    for rank in (0, 1):
        specs, data = chunks_of((torch.full((4,), float(rank)),), 1 << 20)
        barrier.contribute_chunk(rank, 0, "mean", specs, 0, data[0][1], 1.0)
    assert barrier.round == 1 and not barrier.started
    assert entry.expect(5) is None
    assert entry.ready(5) is None
    return entry, barrier


def test_a_rider_enters_its_relays_fold_at_the_entry_round_and_gets_no_result_before() -> None:
    entry, barrier = _relay_at_round_one()
    assert entry.ready(5) == "twice"
    assert entry.first_round[5] > 10**9  # expected, not entered: no round's result goes to it
    refused = entry.enter_riders(Entry(round=1, epoch=1, members=[0, 1, 5], state=True, ranks=[5]), barrier)
    assert refused == {}
    assert barrier.live == frozenset({0, 1, 5}) and entry.first_round[5] == 1
    assert entry.taking_state  # the state chunks that follow are the rider's, not a round to deliver
    assert 5 not in entry.expected


def test_a_rider_is_refused_when_its_relay_has_begun_the_entry_round() -> None:
    entry, barrier = _relay_at_round_one()
    specs, data = chunks_of((torch.full((4,), 1.0),), 1 << 20)
    barrier.contribute_chunk(0, 1, "mean", specs, 0, data[0][1], 1.0)  # rank 0 deposited round 1 already
    refused = entry.enter_riders(Entry(round=1, epoch=1, members=[0, 1, 5], state=True, ranks=[5]), barrier)
    assert refused == {5: "cannot enter at round 1: this relay's fold is at round 1 (started)"}
    assert 5 not in barrier.live
    assert entry.taking_state  # the state that follows is swallowed all the same


def test_the_controller_cannot_let_in_a_rank_that_is_not_a_ready_rider() -> None:
    entry, barrier = _relay_at_round_one()
    assert entry.expect(6) is None  # expected, but never said it was ready
    refused = entry.enter_riders(Entry(round=1, epoch=1, members=[0, 1, 6, 7], ranks=[6, 7]), barrier)
    assert set(refused) == {6, 7} and "before it was a rider ready to enter" in refused[6]
    assert barrier.live == frozenset({0, 1})
    assert entry.expect(0) == "controller expected rank 0, which this relay has served already"
