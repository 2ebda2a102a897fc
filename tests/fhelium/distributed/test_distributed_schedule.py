"""The pure schedules: binomial reduce tree, per-rank steps, limb-range and adjacency rules."""

from __future__ import annotations

import math

import pytest

from fhelium.distributed._schedule import (
    LimbRangeError,
    StepKind,
    binomial_reduce_rounds,
    check_adjacent_prime_intervals,
    reduce_steps,
    validate_limb_ranges,
)

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tree_sends_p_minus_one_messages_in_ceil_log2_rounds(world_size: int) -> None:
    rounds = binomial_reduce_rounds(world_size)
    edges = [edge for round_edges in rounds for edge in round_edges]
    assert len(edges) == world_size - 1
    assert len(rounds) == math.ceil(math.log2(world_size))
    assert sorted(edge.sender for edge in edges) == list(range(1, world_size))
    assert all(edge.receiver < edge.sender for edge in edges)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tree_receiver_gets_at_most_one_message_per_round_and_sender_is_done_after_sending(
    world_size: int,
) -> None:
    finished: set[int] = set()
    for round_edges in binomial_reduce_rounds(world_size):
        receivers = [edge.receiver for edge in round_edges]
        assert len(receivers) == len(set(receivers))
        for edge in round_edges:
            assert edge.sender not in finished and edge.receiver not in finished
        finished.update(edge.sender for edge in round_edges)
    assert finished == set(range(1, world_size))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("root_offset", [0, 1, 2])
def test_reduce_steps_pair_up_across_ranks_for_any_root(world_size: int, root_offset: int) -> None:
    root = root_offset % world_size
    sends = set()
    receives = set()
    for rank in range(world_size):
        steps = reduce_steps(world_size, root, rank)
        kinds = [step.kind for step in steps]
        if rank == root:
            assert StepKind.SEND not in kinds
            assert len(steps) == math.ceil(math.log2(world_size))
        else:
            assert kinds[-1] is StepKind.SEND and kinds.count(StepKind.SEND) == 1
        for step in steps:
            if step.kind is StepKind.SEND:
                sends.add((step.round_index, rank, step.peer))
            else:
                receives.add((step.round_index, step.peer, rank))
    assert sends == receives
    assert len(sends) == world_size - 1


def test_tree_refuses_non_positive_world_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        binomial_reduce_rounds(0)
    with pytest.raises(ValueError, match=r"root_group_rank must be in \[0, 3\)"):
        reduce_steps(3, 3, 0)


def test_limb_ranges_accept_unequal_consecutive_partial_cover() -> None:
    assert validate_limb_ranges([(1, 2), (2, 5), [5, 6]], limb_count=7, world_size=3) == (
        (1, 2),
        (2, 5),
        (5, 6),
    )


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 1)], "exactly one"),
        ([(0, 2), (2, 2)], "empty intervals"),
        ([(0, 2), (3, 4)], "consecutive"),
        ([(0, 2), (1, 4)], "consecutive"),
        ([(0, 2), (2, 9)], "<= 5"),
        ([(-1, 2), (2, 3)], "0 <= start"),
        ([(0, 2.0), (2, 3)], "plain ints"),
        ([(0, True), (1, 3)], "plain ints"),
        ([(0, 1, 2), (2, 3)], "pair"),
        ("ab", "sequence"),
        (None, "sequence"),
    ],
)
def test_limb_ranges_reject_with_a_message_naming_the_rule(ranges: object, message: str) -> None:
    with pytest.raises(LimbRangeError, match=message):
        validate_limb_ranges(ranges, limb_count=5, world_size=2)


def test_adjacent_prime_intervals() -> None:
    check_adjacent_prime_intervals([[2, 3], [4], [5, 6, 7]])
    with pytest.raises(LimbRangeError, match="adjacent"):
        check_adjacent_prime_intervals([[2, 3], [5]])
    with pytest.raises(LimbRangeError, match="adjacent"):
        check_adjacent_prime_intervals([[4], [2, 3]])
    with pytest.raises(LimbRangeError, match="consecutive prime interval"):
        check_adjacent_prime_intervals([[2, 4]])
