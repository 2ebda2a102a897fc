"""Losses under `cpu_sync` averaging with a tolerance: real agents, relays and ranks against an in-process
controller (docs/elastic-averaging.md).

The world is host `a` with ranks 0 and 1 and host `b` with rank 2, tolerance 1. Rank 1 (or host `b`) is
taken out while the others wait in round STALL_ROUND for it. Every test checks, from the ranks' own
lines, that each round's result is the mean over exactly the ranks that round lists (recomputed here),
that every survivor holds the same bytes after each round, that the lost rank is in no later round, and
that the membership epoch and index followed; then the verdict and state.json's `losses`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from tests.hosts import netns

from .workers import AgentProcess, Run, fault_options, fault_run

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).with_name("elastic_program.py")
ROUNDS = 8
STALL_ROUND = 3
FORMATION_BOUND_SECS = 90.0  # three torch imports on a loaded 2-core machine
RUN_BOUND_SECS = 60.0
# Scaled by FLODL_NET_TIMEOUT_SCALE=0.2 (the ranks' environment, and this process's: the controller's): a
# silent rank is declared dead after 5 s, and a rank gives up on a silent controller after 5 s (3 s let
# a loaded 2-core machine starve a waiting rank's heartbeat thread: a false loss, once in 3 runs at load 6).
LIVENESS_ENV = {"FLODL_LIVENESS_TIMEOUT_SECS": "25"}


@pytest.fixture(autouse=True)
def _scaled_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.2")


def _options(tolerance: int = 1) -> Any:  # noqa: ANN401  ControllerOptions
    base = fault_options()
    return fault_options(
        capacity=3,
        tolerance=tolerance,
        join=JoinConfig(join_timeout=60, target_ranks=3, min_rank_start=3),
        env={**base.env, **LIVENESS_ENV},
    )


async def _start(run: Run, **env: str) -> tuple[AgentProcess, AgentProcess]:
    stall = {"ELASTIC_ROUNDS": str(ROUNDS), "ELASTIC_STALL_ROUND": str(STALL_ROUND), **env}
    a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **stall)  # type: ignore[arg-type]  # env names only
    await _admitted(run, 2)  # ranks follow admission order: a's are 0 and 1
    b = await run.spawn_agent("b", ranks=1, program=PROGRAM, **stall)  # type: ignore[arg-type]  # env names only
    return a, b


async def _admitted(run: Run, ranks: int) -> None:
    deadline = time.monotonic() + FORMATION_BOUND_SECS
    while run.state()["joined_ranks"] < ranks:
        assert time.monotonic() < deadline, f"fewer than {ranks} ranks joined within {FORMATION_BOUND_SECS}s"
        await asyncio.sleep(0.05)


def _rounds(*agents: AgentProcess) -> dict[int, dict[int, dict[str, Any]]]:
    """The ranks' round lines, by rank and round."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for agent in agents:
        for match in re.finditer(r"elastic-round (\{.*\})$", agent.output, re.MULTILINE):
            line = json.loads(match[1])
            found.setdefault(line["rank"], {})[line["round"]] = line
    return found


def _check_rounds(
    rounds: dict[int, dict[int, dict[str, Any]]],
    survivors: list[int],
    lost: list[int],
    *,
    lagging: bool = False,
) -> None:
    """Every survivor's rounds: the same bytes, the mean over the members, the membership that followed.

    `lagging` (cpu_async): a call returns the elastic update of an earlier round, each rank its own, and the
    membership it reads after the call is that of the newest round complete by then: the loss's round
    may or may not be in at that call, and only the membership is checked.
    """
    everyone = sorted(survivors + lost)
    for rank in survivors:
        assert sorted(rounds[rank]) == list(range(ROUNDS)), (rank, sorted(rounds[rank]))
    for number in range(ROUNDS):
        lines = [rounds[rank][number] for rank in survivors]
        members = lines[0]["members"]
        if lagging and number == STALL_ROUND:
            continue
        assert all(line["members"] == members for line in lines), (number, lines)
        if number < STALL_ROUND:
            assert members == everyone, (number, members)
        else:  # the round the loss happened in, and every later one, is the survivors'
            assert members == survivors, (number, members)
        for line in lines:
            assert line["epoch"] == (0 if number < STALL_ROUND else 1), line
            assert line["index"] == members.index(line["rank"]), line
        if lagging:
            continue
        # Every survivor holds the same bytes: the mean over exactly these members (the weights renormalized).
        assert {line["sha256"] for line in lines} == {lines[0]["sha256"]}, (number, lines)
        reference = sum(torch.arange(4, dtype=torch.float64) + 1000 * m + number for m in members) / len(
            members
        )
        assert torch.equal(torch.tensor(lines[0]["mean"], dtype=torch.float64), reference), (number, lines)
    for rank in lost:
        assert max(rounds.get(rank, {0: None}), default=-1) < STALL_ROUND


@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_a_rank_lost_mid_round_is_folded_out_and_its_host_mate_trains_on(fault: str) -> None:
    async with fault_run(_options()) as run:
        a, b = await _start(run, ELASTIC_STALL_RANK="1")
        await a.wait_for("elastic-rank 1 stalls before round", FORMATION_BOUND_SECS)
        victim = run.find(RANK="1")
        os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        faulted = time.monotonic()
        try:
            result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        except TimeoutError:
            raise AssertionError(f"no verdict:\n{a.output[-4000:]}\n{b.output[-2000:]}") from None
        print(f"{fault}: run ended {time.monotonic() - faulted:.2f}s after the fault: {result.reason}")
        assert result.verdict is Phase.DONE, (result, a.output[-3000:])
        assert "degraded: ranks [1] lost: rank 1 on 'a'" in result.reason, result.reason
        _check_rounds(_rounds(a, b), survivors=[0, 2], lost=[1])
        body = run.state()
        (loss,) = body["losses"]
        assert (loss["rank"], loss["host"], loss["round"]) == (1, "a", STALL_ROUND), loss
        if fault == "kill":
            assert loss["cause"] == "exited with signal 9", loss
        else:
            # Declared dead by its silence, its stack dumped by the agent (the frame it stalled in), killed.
            assert loss["cause"].startswith("declared dead: rank 1 on 'a' sent no heartbeat for 5s"), loss
            assert "rank 1 declared dead by the controller" in a.output, a.output[-3000:]
            stack = r'File ".*elastic_program\.py", line \d+ in stall_here'
            assert re.search(stack, a.output), a.output[-3000:]
        await run.until_no_processes(10)


async def test_a_host_killed_mid_round_leaves_the_others_averaging() -> None:
    async with fault_run(_options()) as run:
        a, b = await _start(run, ELASTIC_STALL_RANK="2")
        await b.wait_for("elastic-rank 2 stalls before round", FORMATION_BOUND_SECS)
        b.process.send_signal(signal.SIGKILL)  # the agent; its relay and rank die with it (PDEATHSIG)
        killed = time.monotonic()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        took = time.monotonic() - killed
        print(f"host kill: run ended {took:.2f}s after the agent's SIGKILL: {result.reason}")
        assert result.verdict is Phase.DONE, (result, a.output[-3000:])
        assert "degraded: ranks [2] lost: rank 2 on 'b' lost with its host" in result.reason, result.reason
        _check_rounds(_rounds(a), survivors=[0, 1], lost=[2])
        (loss,) = run.state()["losses"]
        assert (loss["rank"], loss["host"], loss["round"]) == (2, "b", STALL_ROUND), loss
        await run.until_no_processes(10)


async def test_losses_beyond_the_tolerance_fail_the_run() -> None:
    async with fault_run(_options()) as run:
        a, _ = await _start(run, ELASTIC_STALL_RANK="1")
        await a.wait_for("elastic-rank 1 stalls before round", FORMATION_BOUND_SECS)
        a.process.send_signal(signal.SIGKILL)  # two ranks with a tolerance of one
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.FAILED, result
        assert "2 of 3 ranks failed (ranks [0, 1]), over the tolerance of 1" in result.reason, result.reason
        await run.until_no_processes(10)


async def test_ranks_that_finish_are_not_declared_dead_while_their_interpreter_winds_down() -> None:
    """A rank's heartbeats stop when interpreter finalization begins; its legs to the relay closed only
    when the process ended, so a finalization longer than the liveness timeout (torch's teardown, on a
    loaded machine) declared every rank that finished dead (bench/chaos.py at 1.5 s: all 8 in the
    fault-free run). The legs now close at exit, a clean leave: the run is `done`, nothing lost.
    """
    short = {"FLODL_LIVENESS_TIMEOUT_SECS": "10"}  # 2 s under the scale of 0.2; finalizing takes 5 s
    options = _options()
    options = options.model_copy(update={"env": {**options.env, **short}})
    async with fault_run(options) as run:
        await _start(run, ELASTIC_ROUNDS="3", ELASTIC_SLOW_EXIT_SECS="5")
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE and "degraded" not in result.reason, result
        assert run.state()["losses"] == []
        await run.until_no_processes(10)


@pytest.mark.parametrize(("mode", "cadence"), [("cpu_cadence", 2), ("cpu_async", 1)])
async def test_cadence_and_async_fold_a_lost_rank_out_at_their_round_boundaries(
    mode: str, cadence: int
) -> None:
    async with fault_run(_options()) as run:
        a, b = await _start(run, ELASTIC_STALL_RANK="1", ELASTIC_MODE=mode, ELASTIC_CADENCE=str(cadence))
        await a.wait_for("elastic-rank 1 stalls before round", FORMATION_BOUND_SECS)
        os.kill(run.find(RANK="1").pid, signal.SIGKILL)
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, a.output[-3000:])
        assert "degraded: ranks [1] lost: rank 1 on 'a' exited with signal 9" in result.reason, result.reason
        _check_rounds(_rounds(a, b), survivors=[0, 2], lost=[1], lagging=mode == "cpu_async")
        finals = re.findall(r"elastic-final (\{.*\})$", a.output + b.output, re.MULTILINE)
        assert sorted(json.loads(final)["rank"] for final in finals) == [0, 2]
        await run.until_no_processes(10)


@pytest.fixture
def far_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side veth, host-side address) with the far end at .2 inside the namespace."""
    with netns.far_namespace("flela", 233) as lab:
        yield lab


@pytest.mark.netns
async def test_a_partitioned_host_is_folded_out_by_its_silence(far_namespace: tuple[str, str, str]) -> None:
    """Host `b` behind a veth pair whose link goes down while the others wait for it in a round: no FIN, no
    RST; its rank's heartbeats stop and it is declared dead after the heartbeat timeout (5 s here), before
    TCP keepalive gives up on the join link, which then marks the host lost.
    """
    namespace, near, near_address = far_namespace
    # the join link's keepalive (scaled: 8 s idle, given up after about twice that) outlasts the 5 s heartbeat
    # timeout, so the silence is what folds the host out, as it would be with the defaults unscaled
    options = _options().model_copy(
        update={"bind_host": "0.0.0.0", "advertised_host": near_address, "link_keepalive_secs": 40.0}
    )
    async with fault_run(options) as run:
        stall = {
            "ELASTIC_ROUNDS": str(ROUNDS),
            "ELASTIC_STALL_ROUND": str(STALL_ROUND),
            "ELASTIC_STALL_RANK": "2",
        }
        a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **stall)  # type: ignore[arg-type]  # env names only
        await _admitted(run, 2)
        b = await run.spawn_agent(
            "b",
            ranks=1,
            program=PROGRAM,
            wrapper=("ip", "netns", "exec", namespace),
            controller_host=near_address,
            **stall,
        )
        await b.wait_for("elastic-rank 2 stalls before round", FORMATION_BOUND_SECS)
        netns.ip("link", "set", near, "down")
        cut_at = time.monotonic()
        try:
            result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        finally:
            netns.ip("link", "set", near, "up")
        print(
            f"partition: verdict {time.monotonic() - cut_at:.2f}s after the link went down: {result.reason}"
        )
        assert result.verdict is Phase.DONE, (result, a.output[-3000:])
        assert (
            "degraded: ranks [2] lost: rank 2 on 'b' declared dead: rank 2 on 'b' sent no heartbeat for 5s"
            in (result.reason)
        )
        _check_rounds(_rounds(a), survivors=[0, 1], lost=[2])
        assert {m["host"]: m["link"] for m in run.state()["members"]}["b"] == "lost"
