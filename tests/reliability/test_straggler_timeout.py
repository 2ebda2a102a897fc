"""`straggler_timeout` under `cpu_cadence`: a rank that is late (asleep, heartbeating) is skipped for the
rounds that close without it, and is in the rounds after (docs/elastic-averaging.md). Real agents, relays
and ranks against an in-process controller, as in test_elastic_averaging.

Host `a` has ranks 0 and 1, host `b` rank 2. Rank 1 sleeps LATE_SECS before depositing round LATE_ROUND.
Rank k's bundle in round r is `arange(4) + 1000 * 4**k + r` (elastic_program's ELASTIC_SCALE=4), so each
result tells which ranks and which round it holds: the test finds, for every line of every rank, the one
set of members whose mean (recomputed here) it equals bit for bit, in that line's own round.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from typing import Any

import pytest
import torch

from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase

from .test_elastic_averaging import FORMATION_BOUND_SECS, PROGRAM, _rounds, _start
from .workers import fault_options, fault_run

pytestmark = pytest.mark.multiproc

ROUNDS = 14
LATE_ROUND = 3
# Past TIMEOUT_SECS with room to spare (the others deposit that round within moments of the late rank
# starting its sleep: they all got the round before's result together), so rounds close without it and
# it is in the rounds after: 4 s (was 6 s).
LATE_SECS = 4.0
TIMEOUT_SECS = 1.5
RUN_BOUND_SECS = 90.0


@pytest.fixture(autouse=True)
def _scaled_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.2")


def _mean(members: tuple[int, ...], number: int) -> torch.Tensor:
    deposits = [torch.arange(4, dtype=torch.float64) + 1000 * 4**m + number for m in members]
    total = deposits[0]
    for deposit in deposits[1:]:
        total = total + deposit
    mean: torch.Tensor = total / len(members)
    return mean


def _members_of(mean: list[float], number: int) -> tuple[int, ...]:
    """The one set of ranks whose round-`number` mean is `mean`, bit for bit (AssertionError if none)."""
    got = torch.tensor(mean, dtype=torch.float64)
    for size in (1, 2, 3):
        for members in itertools.combinations(range(3), size):
            if torch.equal(got, _mean(members, number)):
                return members
    raise AssertionError(f"round {number}'s result {mean} is no mean over any ranks of that round")


def _options(mode: str, ranks: int) -> Any:  # noqa: ANN401  ControllerOptions
    return fault_options(
        capacity=ranks,
        averaging=mode,
        cadence=1,
        straggler_timeout=TIMEOUT_SECS,
        join=JoinConfig(join_timeout=60, target_ranks=ranks, min_rank_start=ranks),
        env=dict(fault_options().env),
    )


def _late(mode: str, rank: int = 1) -> dict[str, str]:
    return {
        "ELASTIC_LATE_RANK": str(rank),
        "ELASTIC_LATE_ROUND": str(LATE_ROUND),
        "ELASTIC_LATE_SECS": str(LATE_SECS),
        "ELASTIC_SCALE": "4",
        "ELASTIC_MODE": mode,
        "ELASTIC_CADENCE": "1",
        "ELASTIC_ROUNDS": str(ROUNDS),
    }


def _skipped(state: dict[str, Any]) -> dict[int, int]:
    return {row["rank"]: row.get("skipped", 0) for row in state.get("stragglers", [])}


@pytest.mark.parametrize("late", [1, 2], ids=["rank-late-at-its-relay", "host-late-at-the-controller"])
async def test_a_late_rank_is_skipped_for_the_rounds_that_close_without_it_and_is_in_later_ones(
    late: int,
) -> None:
    """Rank 1 shares host `a` with rank 0: its relay skips it. Rank 2 is host `b`'s only rank: the
    controller skips host `b`, and `b`'s relay closes the round it never saw a deposit of when the
    round's result comes down.
    """
    others = tuple(rank for rank in range(3) if rank != late)
    async with fault_run(_options("cpu_cadence", 3)) as run:
        started = time.monotonic()
        a, b = await _start(run, **_late("cpu_cadence", late))
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS + FORMATION_BOUND_SECS)
        print(f"straggler run took {time.monotonic() - started:.1f}s")
        assert result.verdict is Phase.DONE, (result, a.output[-3000:], b.output[-3000:])
        assert "degraded" not in result.reason, result.reason  # late is not lost
        rounds = _rounds(a, b)
        assert sorted(rounds) == [0, 1, 2]
        members: dict[int, tuple[int, ...]] = {}
        for number in range(ROUNDS):
            lines = [rounds[rank][number] for rank in range(3)]
            # Every rank's call for this round got this round's result (never another round's tensors),
            # the same bytes on every rank, the late one included.
            assert {line["sha256"] for line in lines} == {lines[0]["sha256"]}, (number, lines)
            members[number] = _members_of(lines[0]["mean"], number)
        assert all(members[number] == (0, 1, 2) for number in range(LATE_ROUND)), members
        # The round the late rank slept through closed over the other two, with their mean.
        assert members[LATE_ROUND] == others, members
        # The others were never skipped; the late rank was skipped while it slept and is back later.
        assert all(set(others) <= set(held) for held in members.values()), members
        assert any(late in members[number] for number in range(LATE_ROUND + 1, ROUNDS)), members
        skipped = [number for number, held in members.items() if late not in held]
        state = run.state()
        counts = _skipped(state)
        assert counts.get(late) == len(skipped), (counts, skipped)
        assert all(counts.get(rank, 0) == 0 for rank in others), counts
        assert not state.get("losses"), state.get("losses")
        print(f"rounds closed without rank {late}: {skipped}")
        await run.until_no_processes(10)


async def test_a_world_of_one_host_skips_its_late_rank_at_the_relay() -> None:
    """The relay's fold is the world's (sole host): its own timer closes the round over rank 0 alone."""
    async with fault_run(_options("cpu_cadence", 2)) as run:
        a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **_late("cpu_cadence"))  # type: ignore[arg-type]  # env names only
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS + FORMATION_BOUND_SECS)
        assert result.verdict is Phase.DONE and "degraded" not in result.reason, (result, a.output[-3000:])
        rounds = _rounds(a)
        members = {}
        for number in range(ROUNDS):
            lines = [rounds[rank][number] for rank in range(2)]
            assert {line["sha256"] for line in lines} == {lines[0]["sha256"]}, (number, lines)
            members[number] = _members_of(lines[0]["mean"], number)
        assert members[LATE_ROUND] == (0,), members
        assert all(0 in held for held in members.values()), members
        assert any(members[number] == (0, 1) for number in range(LATE_ROUND + 1, ROUNDS)), members
        assert "closes without rank(s) [1]" in a.output
        await run.until_no_processes(10)


async def test_cpu_async_rounds_close_without_a_late_rank_and_every_rank_finishes() -> None:
    """cpu_async: a call returns an elastic update, not the mean, so the rounds are checked through the
    controller's skipped counts; every rank applies its last round (`finish`) and the run is not degraded.
    """
    async with fault_run(_options("cpu_async", 3)) as run:
        a, b = await _start(run, **_late("cpu_async"))
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS + FORMATION_BOUND_SECS)
        assert result.verdict is Phase.DONE and "degraded" not in result.reason, (result, a.output[-3000:])
        finals = re.findall(r"elastic-final (\{.*\})$", a.output + b.output, re.MULTILINE)
        assert sorted(json.loads(final)["rank"] for final in finals) == [0, 1, 2]
        counts = _skipped(run.state())
        assert counts.get(1, 0) >= 1 and counts.get(0, 0) == counts.get(2, 0) == 0, counts
        await run.until_no_processes(10)
