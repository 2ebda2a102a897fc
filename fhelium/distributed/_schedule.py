"""Pure collective schedules: the binomial reduce tree and limb-interval rules.

Sans-io: no torch, no process groups. The shells in ``_ciphertext_reduction`` and
``_limb_collectives`` ask these functions what to do and then do it, so every rule here
is testable without spawning a process.

Ranks here are *group-relative*; the reduce tree works on *logical* ranks, i.e. group
ranks rotated so that the reduction root is logical rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class TreeEdge:
    """One ciphertext message of the reduce tree, between logical ranks."""

    sender: int
    receiver: int


def binomial_reduce_rounds(world_size: int) -> tuple[tuple[TreeEdge, ...], ...]:
    """Rounds of a binomial reduce tree rooted at logical rank 0, for any world size.

    In round ``k`` (distance ``d = 2**k``) every logical rank ``r`` divisible by ``2d``
    receives from ``r + d`` when that rank exists. Every rank except 0 sends exactly once,
    so there are ``P - 1`` messages in ``ceil(log2 P)`` rounds, and a receiver gets at most
    one message per round (one incoming buffer suffices).
    """
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    rounds: list[tuple[TreeEdge, ...]] = []
    distance = 1
    while distance < world_size:
        rounds.append(
            tuple(
                TreeEdge(sender=receiver + distance, receiver=receiver)
                for receiver in range(0, world_size, 2 * distance)
                if receiver + distance < world_size
            )
        )
        distance *= 2
    return tuple(rounds)


def logical_rank(group_rank: int, root_group_rank: int, world_size: int) -> int:
    """Position of ``group_rank`` in a tree whose root is ``root_group_rank``."""
    return (group_rank - root_group_rank) % world_size


def group_rank_of_logical(logical: int, root_group_rank: int, world_size: int) -> int:
    """Inverse of :func:`logical_rank`."""
    return (logical + root_group_rank) % world_size


class StepKind(Enum):
    SEND = "send"
    RECEIVE = "receive"


@dataclass(frozen=True)
class ReduceStep:
    """What one rank does in one round: send its partial sum to, or receive one from, ``peer``.

    ``peer`` is a group-relative rank; ``round_index`` doubles as the message tag.
    """

    round_index: int
    kind: StepKind
    peer: int


def reduce_steps(world_size: int, root_group_rank: int, group_rank: int) -> tuple[ReduceStep, ...]:
    """The ordered steps ``group_rank`` performs in a reduce to ``root_group_rank``.

    A rank receives in zero or more rounds, then sends once (unless it is the root) and is
    done: after sending, its own value holds only a partial sum.
    """
    for name, rank in (("root_group_rank", root_group_rank), ("group_rank", group_rank)):
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"{name} must be in [0, {world_size}); got {rank!r}")
    me = logical_rank(group_rank, root_group_rank, world_size)
    steps: list[ReduceStep] = []
    for round_index, edges in enumerate(binomial_reduce_rounds(world_size)):
        for edge in edges:
            if edge.receiver == me:
                peer = group_rank_of_logical(edge.sender, root_group_rank, world_size)
                steps.append(ReduceStep(round_index, StepKind.RECEIVE, peer))
            elif edge.sender == me:
                peer = group_rank_of_logical(edge.receiver, root_group_rank, world_size)
                steps.append(ReduceStep(round_index, StepKind.SEND, peer))
                return tuple(steps)
    return tuple(steps)


class LimbRangeError(ValueError):
    """``limb_ranges`` do not describe one consecutive nonempty interval per group rank."""


def validate_limb_ranges(
    limb_ranges: object, *, limb_count: int, world_size: int
) -> tuple[tuple[int, int], ...]:
    """Check caller-selected ``(start, stop)`` limb intervals and return them normalised.

    Rules: exactly one interval per group rank, each ``0 <= start < stop <= limb_count``
    with plain ints, and consecutive in group-rank order (``stop[i] == start[i + 1]``).
    Unequal lengths and a partial cover of the stored limbs are allowed.
    """
    if isinstance(limb_ranges, (str, bytes)) or not isinstance(limb_ranges, Sequence):
        raise LimbRangeError(
            f"limb_ranges must be a sequence of (start, stop) pairs, one per group rank; "
            f"got {type(limb_ranges).__name__}"
        )
    if len(limb_ranges) != world_size:
        raise LimbRangeError(
            f"limb_ranges must hold exactly one (start, stop) per group rank: "
            f"got {len(limb_ranges)} for group size {world_size}"
        )
    normalised: list[tuple[int, int]] = []
    for group_rank, interval in enumerate(limb_ranges):
        if isinstance(interval, (str, bytes)) or not isinstance(interval, Sequence) or len(interval) != 2:
            raise LimbRangeError(f"limb_ranges[{group_rank}] must be a (start, stop) pair; got {interval!r}")
        start, stop = interval
        if type(start) is not int or type(stop) is not int:
            raise LimbRangeError(f"limb_ranges[{group_rank}] must hold plain ints; got {interval!r}")
        if not 0 <= start < stop <= limb_count:
            raise LimbRangeError(
                f"limb_ranges[{group_rank}]={interval!r} must satisfy 0 <= start < stop <= "
                f"{limb_count} (the source's stored limb count); empty intervals are not allowed"
            )
        if normalised and normalised[-1][1] != start:
            raise LimbRangeError(
                f"limb_ranges must be consecutive in group-rank order: limb_ranges[{group_rank - 1}]"
                f" ends at {normalised[-1][1]} but limb_ranges[{group_rank}] starts at {start}"
            )
        normalised.append((start, stop))
    return tuple(normalised)


def check_adjacent_prime_intervals(prime_id_lists: Sequence[Sequence[int]]) -> None:
    """Require the shards' ``prime_ids`` to continue each other without gap or overlap.

    Each shard must itself be a run of consecutive canonical prime ids, and the first id of
    shard ``i + 1`` must follow the last id of shard ``i``.
    """
    if not prime_id_lists:
        raise LimbRangeError("limb gather needs at least one shard")
    previous_last: int | None = None
    for group_rank, prime_ids in enumerate(prime_id_lists):
        ids = list(prime_ids)
        if not ids:
            raise LimbRangeError(f"limb shard of group rank {group_rank} holds no limbs")
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise LimbRangeError(
                f"limb shard of group rank {group_rank} must hold a consecutive prime interval; "
                f"got prime_ids={ids}"
            )
        if previous_last is not None and ids[0] != previous_last + 1:
            raise LimbRangeError(
                f"limb shards must hold adjacent prime intervals in group-rank order: group rank "
                f"{group_rank - 1} ends at prime {previous_last}, group rank {group_rank} starts at "
                f"prime {ids[0]}"
            )
        previous_last = ids[-1]
