"""The straggler timeout's rules, sans-io: skipping a late member for one round, its late chunks dropped,
the round closing over those who deposited, and the clock that says when (flodld.fold.straggler).
"""

from __future__ import annotations

import pytest
import torch

from flodld.fold.barrier import RoundBarrier, RoundError
from flodld.fold.straggler import StragglerClock
from tests.flodld.fold.test_fold_chunks import assemble, chunks_of


def test_a_skipped_member_is_out_of_that_round_only_and_its_late_deposit_is_dropped() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1, 2])
    specs, data = chunks_of((torch.full((8,), 3.0),), 1 << 20)
    _, ones = chunks_of((torch.ones(8),), 1 << 20)
    assert barrier.contribute_chunk(0, 0, "mean", specs, 0, data[0][1], 1.0) == []
    assert barrier.contribute_chunk(1, 0, "mean", specs, 0, ones[0][1], 1.0) == []
    out = barrier.skip(barrier.waiting_for)
    assert [(r.round, sorted(r.contributors), r.weight, r.last) for r in out] == [(0, [0, 1], 2.0, True)]
    assert torch.equal(assemble(out, finish=True)[0], torch.full((8,), 2.0))
    assert barrier.round == 1 and barrier.live == {0, 1, 2} and barrier.skips == 1
    # Rank 2's deposit of round 0 arrives now: dropped (released at once), never folded into round 1.
    released: list[int] = []
    _, sevens = chunks_of((torch.full((8,), 7.0),), 1 << 20)
    late = barrier.contribute_chunk(2, 0, "mean", specs, 0, sevens[0][1], 1.0, lambda: released.append(2))
    assert late == [] and released == [2] and barrier.late_chunks == 1
    # Round 1 waits for all three again, rank 2 included.
    assert barrier.waiting_for == {0, 1, 2}
    out = []
    for rank, value in ((0, 1.0), (1, 2.0), (2, 6.0)):
        _, deposit = chunks_of((torch.full((8,), value),), 1 << 20)
        out += barrier.contribute_chunk(rank, 1, "mean", specs, 0, deposit[0][1], 1.0)
    assert [sorted(r.contributors) for r in out] == [[0, 1, 2]]
    assert torch.equal(assemble(out, finish=True)[0], torch.full((8,), 3.0))
    # A deposit for a round it was not skipped in is still a double deposit or out of turn.
    with pytest.raises(RoundError, match="barrier is at round 2"):
        barrier.contribute_chunk(2, 1, "mean", specs, 0, sevens[0][1], 1.0)


def test_a_member_skipped_mid_deposit_is_in_the_chunks_it_sent_and_its_later_chunks_are_late() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    specs, threes = chunks_of((torch.full((32,), 3.0),), 64)
    _, ones = chunks_of((torch.ones(32),), 64)
    out = barrier.contribute_chunk(0, 0, "mean", specs, 0, threes[0][1], 1.0)
    out += barrier.contribute_chunk(0, 0, "mean", specs, 64, threes[1][1], 1.0)
    out += barrier.contribute_chunk(1, 0, "mean", specs, 0, ones[0][1], 1.0)
    out += barrier.skip([1])
    assert [(r.offset, sorted(r.contributors), r.last) for r in out] == [(0, [0, 1], False), (64, [0], True)]
    want = torch.cat([torch.full((16,), 2.0), torch.full((16,), 3.0)])
    assert torch.equal(assemble(out, finish=True)[0], want)
    assert barrier.contribute_chunk(1, 0, "mean", specs, 64, ones[1][1], 1.0) == []
    assert barrier.late_chunks == 1 and barrier.round == 1


def test_a_round_every_owing_member_was_skipped_in_closes_without_a_value() -> None:
    """The hop above closed the round (its broadcast came down): every member still owing is skipped. A
    chunk nobody folded is never handed on, and the round closes so that the next one can start.
    """
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    specs, threes = chunks_of((torch.full((32,), 3.0),), 64)
    out = barrier.contribute_chunk(0, 0, "mean", specs, 0, threes[0][1], 1.0)
    out += barrier.skip(barrier.waiting_for)
    assert [(r.offset, r.last) for r in out] == [(0, False)]
    assert barrier.round == 1 and barrier.waiting_for == {0, 1}
    assert barrier.contribute_chunk(0, 0, "mean", specs, 64, threes[1][1], 1.0) == []
    empty: RoundBarrier[int] = RoundBarrier([0, 1])
    assert empty.skip(empty.waiting_for) == [] and empty.round == 1 and not empty.started
    assert empty.contribute_chunk(1, 0, "mean", specs, 0, threes[0][1], 1.0) == []  # late


def test_a_member_that_leaves_while_the_rest_of_the_round_was_skipped_closes_it() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1, 2])
    specs, threes = chunks_of((torch.full((8,), 3.0),), 1 << 20)
    barrier.skip([2])
    out = barrier.contribute_chunk(0, 0, "mean", specs, 0, threes[0][1], 1.0)
    out += barrier.leave(1)
    assert [(sorted(r.contributors), r.last) for r in out] == [([0], True)]
    assert barrier.round == 1 and barrier.live == {0, 2}


def test_the_clock_opens_a_round_at_its_first_chunk_and_is_due_a_timeout_later() -> None:
    clock = StragglerClock(2.0)
    assert clock.wake_at(0) is None and not clock.due(0, 100.0)
    clock.opened(0, 10.0)
    clock.opened(0, 11.0)  # a later chunk of the same round does not move the deadline
    assert clock.wake_at(0) == 12.0 and not clock.due(0, 11.9) and clock.due(0, 12.0)
    assert clock.wake_at(1) is None and not clock.due(1, 50.0)
    clock.opened(1, 20.0)
    assert clock.wake_at(1) == 22.0 and clock.wake_at(0) is None
    never = StragglerClock(None)
    never.opened(0, 0.0)
    assert never.wake_at(0) is None and not never.due(0, 1e9)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="straggler_timeout"):
            StragglerClock(bad)


def test_arm_says_when_to_look_only_for_the_chunk_that_opens_the_round() -> None:
    clock = StragglerClock(2.0)
    assert clock.arm(0, now=10.0) == 12.0  # the round's first chunk: set the timer
    assert clock.arm(0, now=11.0) is None  # open already: the deadline stays the first chunk's
    assert clock.wake_at(0) == 12.0
    assert clock.arm(1, now=13.0) == 15.0  # the next round opens its own clock
    assert StragglerClock(None).arm(0, now=1.0) is None  # no timeout: no timer


def test_late_names_the_members_still_owing_the_round_once_it_is_due_and_still_open() -> None:
    clock = StragglerClock(1.0)
    barrier: RoundBarrier[int] = RoundBarrier([2, 0, 1])
    specs, data = chunks_of((torch.ones(4),), 1 << 20)
    barrier.contribute_chunk(1, 0, "mean", specs, 0, data[0][1], 1.0)
    clock.opened(0, 5.0)
    assert clock.late(barrier, 0, now=5.5) is None  # not due yet
    assert clock.late(barrier, 0, now=6.0) == [0, 2]  # due: the owing members, sorted
    assert clock.late(barrier, 1, now=6.0) is None  # not the barrier's round
    assert clock.late(None, 0, now=6.0) is None  # no barrier yet
