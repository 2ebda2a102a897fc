"""A member entering the round barrier at a boundary (growth during training, docs/elastic-averaging.md
"Growth and healing"): `admit` between rounds only, `begin_at` for a walk-in relay's first round.
"""

from __future__ import annotations

import pytest
import torch

from flodld.fold.barrier import RoundBarrier, RoundError
from tests.flodld.fold.test_fold_chunks import assemble, chunks_of


def deposit(barrier: RoundBarrier[str], member: str, round_number: int, value: float) -> list:  # type: ignore[type-arg]
    specs, data = chunks_of((torch.full((4,), value),), 1 << 20)
    return barrier.contribute_chunk(member, round_number, "mean", specs, 0, data[0][1], 1.0)


def test_a_member_enters_at_a_boundary_and_is_in_every_later_round() -> None:
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    deposit(barrier, "a", 0, 1.0)
    with pytest.raises(RoundError, match="it has started"):
        barrier.admit("c")  # the round's fold order is fixed once its first chunk is in
    out = deposit(barrier, "b", 0, 3.0)
    assert torch.equal(assemble(out, finish=True)[0], torch.full((4,), 2.0))
    barrier.admit("c")
    with pytest.raises(RoundError, match="a member already"):
        barrier.admit("c")
    assert deposit(barrier, "a", 1, 1.0) == [] and deposit(barrier, "b", 1, 2.0) == []  # waits for c
    out = deposit(barrier, "c", 1, 6.0)
    assert sorted(out[0].contributors) == ["a", "b", "c"]
    assert torch.equal(assemble(out, finish=True)[0], torch.full((4,), 3.0))


def test_a_member_that_left_may_enter_again() -> None:
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    barrier.leave("b")
    barrier.admit("b")
    deposit(barrier, "a", 0, 1.0)
    out = deposit(barrier, "b", 0, 5.0)
    assert sorted(out[0].contributors) == ["a", "b"]


def test_begin_at_numbers_a_walk_ins_first_round_and_never_goes_back() -> None:
    barrier: RoundBarrier[str] = RoundBarrier(["a"])
    barrier.begin_at(7)
    with pytest.raises(RoundError, match="barrier is at round 7"):
        deposit(barrier, "a", 0, 1.0)
    assert deposit(barrier, "a", 7, 1.0)[0].round == 7
    with pytest.raises(RoundError, match="from round 8 to 3"):
        barrier.begin_at(3)
