"""Growth and healing: walk-ins enter a training run with its last averaged state (docs/elastic-averaging.md,
"Growth and healing"). Real agents, relays and ranks against an in-process controller.

The formed world is host `a` with ranks 0 and 1 and host `b` with rank 2 (`heal_program.py`); they stop
before round GATE (`heal-stall`) until the test opens the gate, so that a walk-in whose relay comes up then
enters at exactly that round boundary. Every test checks, from the ranks' own lines: the walk-in's state is
the result of round GATE - 1 every member received, bit for bit (SHA-256); from round GATE on every rank
receives the same bytes, the mean over the new member set (recomputed here), and the membership (epoch,
index, size) follows; state.json `joins` records the walk-in and the round it entered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from tests.agent_proc import start_agent

from .workers import FAST_ENV, MARK, AgentProcess, Run, fault_options, fault_run

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).with_name("heal_program.py")
ROUNDS = 7
GATE = 3
FORMATION_BOUND_SECS = 90.0  # several torch imports on a loaded 2-core machine
RUN_BOUND_SECS = 90.0
# Scaled by FLODL_NET_TIMEOUT_SCALE=0.2: 12 s. A walk-in starts while the others wait; on a loaded box its
# relay importing torch (at its first deposit) holds the heartbeats it forwards for a few seconds.
LIVENESS_ENV = {"FLODL_LIVENESS_TIMEOUT_SECS": "60"}


@pytest.fixture(autouse=True)
def _scaled_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.2")


def _options(*, bound: int | None = 4, tolerance: int = 1, mode: str = "cpu_sync") -> Any:  # noqa: ANN401
    base = fault_options()
    return fault_options(
        capacity=3,
        tolerance=tolerance,
        averaging=mode,
        join=JoinConfig(join_timeout=60, target_ranks=3, min_rank_start=3, elastic_max_ranks=bound),
        env={**base.env, **LIVENESS_ENV},
    )


async def _until(what: str, check: Any, bound: float = FORMATION_BOUND_SECS) -> None:  # noqa: ANN401
    deadline = time.monotonic() + bound
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {bound}s"
        await asyncio.sleep(0.05)


async def _form(run: Run, gate: Path, **env: str) -> tuple[AgentProcess, AgentProcess]:
    """Hosts a (ranks 0, 1) and b (rank 2), stopped before round GATE."""
    program = {"HEAL_ROUNDS": str(ROUNDS), "HEAL_GATE_ROUND": str(GATE), "HEAL_GATE": str(gate), **env}
    a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
    await _until("admission of a", lambda: run.state()["joined_ranks"] >= 2)
    b = await run.spawn_agent("b", ranks=1, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
    for agent, ranks in ((a, (0, 1)), (b, (2,))):
        for rank in ranks:
            await agent.wait_for(f"heal-stall rank {rank} before round {GATE}", FORMATION_BOUND_SECS)
    return a, b


async def _walk_in(run: Run, host: str, gate: Path, **env: str) -> AgentProcess:
    """`host` walks in with one rank; the gate opens once it entered (at round GATE)."""
    program = {"HEAL_ROUNDS": str(ROUNDS), "HEAL_GATE_ROUND": str(GATE), **env}
    agent = await run.spawn_agent(host, ranks=1, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
    await _until(f"{host}'s entry", lambda: any(j["round"] is not None for j in run.state()["joins"]))
    gate.touch()
    return agent


def _lines(kind: str, *agents: AgentProcess) -> list[dict[str, Any]]:
    text = "".join(agent.output for agent in agents)
    return [json.loads(match[1]) for match in re.finditer(rf"{kind} (\{{.*\}})$", text, re.MULTILINE)]


def _reference(members: list[int], number: int) -> torch.Tensor:
    total = torch.zeros(4, dtype=torch.float64)
    for m in members:  # the fold's order (sorted members), as the fold adds them
        total = total + (torch.arange(4, dtype=torch.float64) + 1000 * m + number)
    return total / len(members)


def _check(
    agents: tuple[AgentProcess, ...],
    *,
    before: list[int],
    after: list[int],
    walk_in: int,
    exact: bool,
    entered: int = GATE,
) -> None:
    """The walk-in's state is round `entered` - 1's result bit for bit; from round `entered` on every rank
    gets the same bytes (the mean over `after`, when `exact`), and the membership reflects `after`.
    """
    results: dict[int, dict[int, str]] = {}
    means: dict[int, list[float]] = {}
    for line in _lines("heal-result", *agents):
        results.setdefault(line["round"], {})[line["rank"]] = line["sha256"]
        means[line["round"]] = line["mean"]
    (entry,) = _lines("heal-entry", *agents)
    assert (entry["rank"], entry["round"]) == (walk_in, entered), entry
    assert entry["members"] == after and entry["index"] == after.index(walk_in), entry
    state_round = results[entered - 1]
    assert sorted(state_round) == before, state_round
    assert {entry["state_sha256"]} == set(state_round.values()), (entry, state_round)
    if exact:
        reference = _reference(before, entered - 1)
        assert torch.equal(torch.tensor(entry["state"], dtype=torch.float64), reference)
    for number in range(entered, ROUNDS):
        got = results[number]
        assert sorted(got) == after, (number, got)
        assert len(set(got.values())) == 1, (number, got)  # one fold, the same bytes on every rank
        if exact:
            reference = _reference(after, number)
            assert torch.equal(torch.tensor(means[number], dtype=torch.float64), reference), number
    rounds = _lines("heal-round", *agents)
    epochs = {line["rank"]: line["epoch"] for line in rounds if line["round"] == ROUNDS - 1}
    assert sorted(epochs) == after and len(set(epochs.values())) == 1, epochs
    for line in rounds:
        if line["round"] == ROUNDS - 1:
            assert line["members"] == after and line["size"] == len(after), line
            assert line["index"] == after.index(line["rank"]), line
    formed_epochs = {
        line["epoch"] for line in rounds if line["round"] == entered - 1 and line["rank"] in before
    }
    assert all(epoch < epochs[walk_in] for epoch in formed_epochs), (formed_epochs, epochs)


@pytest.mark.parametrize(("mode", "cadence"), [("cpu_sync", 1), ("cpu_cadence", 2), ("cpu_async", 1)])
async def test_a_walk_in_enters_at_a_round_boundary_with_the_averaged_state(
    tmp_path: Path, mode: str, cadence: int
) -> None:
    gate = tmp_path / "gate"
    env = {"HEAL_MODE": mode, "HEAL_CADENCE": str(cadence)} if mode != "cpu_sync" else {}
    async with fault_run(_options(mode=mode)) as run:
        a, b = await _form(run, gate, **env)
        c = await _walk_in(run, "c", gate, **env)
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, c.output[-3000:])
        _check((a, b, c), before=[0, 1, 2], after=[0, 1, 2, 3], walk_in=3, exact=mode != "cpu_async")
        body = run.state()
        assert [(j["rank"], j["host"], j["round"]) for j in body["joins"]] == [(3, "c", GATE)], body["joins"]
        assert body["losses"] == [], body["losses"]
        await run.until_no_processes(10)


async def test_a_walk_in_arriving_in_a_round_in_progress_enters_after_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks 0 and 1 deposit round GATE, rank 2 stops before it: the walk-in's rank is ready in a round in
    progress, waits for its end, and enters at GATE + 1 with round GATE's result as its state.
    """
    caplog.set_level(logging.INFO, logger="flodld.controller.dataplane")
    gate = tmp_path / "gate"
    async with fault_run(_options()) as run:
        program = {"HEAL_ROUNDS": str(ROUNDS), "HEAL_GATE_ROUND": str(GATE), "HEAL_GATE": str(gate),
                   "HEAL_GATE_RANKS": "2"}  # fmt: skip
        a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
        await _until("admission of a", lambda: run.state()["joined_ranks"] >= 2)
        b = await run.spawn_agent("b", ranks=1, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
        await b.wait_for(f"heal-stall rank 2 before round {GATE}", FORMATION_BOUND_SECS)
        c = await run.spawn_agent("c", ranks=1, program=PROGRAM, HEAL_ROUNDS=str(ROUNDS))
        await _until("c's rank connected", lambda: "event=walk_in_ready host=c" in caplog.text)
        assert [j["round"] for j in run.state()["joins"]] == [None]  # round GATE is in progress: it waits
        gate.touch()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, c.output[-3000:])
        _check((a, b, c), before=[0, 1, 2], after=[0, 1, 2, 3], walk_in=3, exact=True, entered=GATE + 1)
        assert [(j["rank"], j["round"]) for j in run.state()["joins"]] == [(3, GATE + 1)]
        await run.until_no_processes(10)


@pytest.mark.parametrize(
    ("slow", "sign"), [("HEAL_START_GATE", "heal-sleep rank 3"), ("HEAL_READY_GATE", "heal-connected rank 3")]
)
async def test_a_walk_in_enters_once_its_ranks_are_ready_and_never_holds_the_members(
    tmp_path: Path, slow: str, sign: str
) -> None:
    """The walk-in's relay comes up while the members wait before round GATE, but its rank is slow: it
    waits for a file before it even connects (HEAL_START_GATE), or once connected, before its first
    averaging call (HEAL_READY_GATE: a script slow to set up). The members go on through rounds
    GATE..later - 1 while it sleeps (had it entered at GATE, they would wait in GATE for its deposit and
    never get there), and it enters at the first round not started once its rank waits to enter, with the
    bytes of the round before.
    """
    gate, gate2, awake = tmp_path / "gate", tmp_path / "gate2", tmp_path / "awake"
    later, rounds = GATE + 10, GATE + 13
    gates = {"HEAL_ROUNDS": str(rounds), "HEAL_GATE2_ROUND": str(later), "HEAL_GATE2": str(gate2)}
    async with fault_run(_options()) as run:
        a, b = await _form(run, gate, **gates)
        c = await run.spawn_agent("c", ranks=1, program=PROGRAM, **{slow: str(awake)}, **gates)  # type: ignore[arg-type]
        await c.wait_for("relay: host 'c' ranks [3] -> controller", FORMATION_BOUND_SECS)  # its DATA is up
        await c.wait_for(sign, FORMATION_BOUND_SECS)
        gate.touch()  # the members go on while the walk-in's rank sleeps
        for agent, rank in ((a, 0), (a, 1), (b, 2)):
            await agent.wait_for(f"heal-stall2 rank {rank} before round {later}", FORMATION_BOUND_SECS)
        assert [j["round"] for j in run.state()["joins"]] == [None]  # its rank is not ready: not in
        awake.touch()
        await _until("c's entry", lambda: [j["round"] for j in run.state()["joins"]] == [later])
        gate2.touch()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, c.output[-3000:])
        results: dict[int, dict[int, str]] = {}
        for line in _lines("heal-result", a, b, c):
            results.setdefault(line["round"], {})[line["rank"]] = line["sha256"]
        for number in range(GATE, later):  # completed by the members while the walk-in slept
            assert sorted(results[number]) == [0, 1, 2], (number, results[number])
        (entry,) = _lines("heal-entry", c)
        assert (entry["rank"], entry["round"], entry["members"]) == (3, later, [0, 1, 2, 3]), entry
        assert {entry["state_sha256"]} == set(results[later - 1].values()), (entry, results[later - 1])
        for number in range(later, rounds):
            assert sorted(results[number]) == [0, 1, 2, 3] and len(set(results[number].values())) == 1
        await run.until_no_processes(10)


async def test_a_replacement_heals_the_world_after_a_host_is_lost(tmp_path: Path) -> None:
    """Host b is killed (tolerance 1); b walks in again under its name (what `fdl join --persist` does) with a
    fresh rank id, and the world is back to three ranks.
    """
    gate = tmp_path / "gate"
    async with fault_run(_options(bound=3)) as run:
        a, b = await _form(run, gate)
        b.process.send_signal(signal.SIGKILL)  # the agent; its relay and rank die with it (PDEATHSIG)
        await _until("b's loss", lambda: [loss["rank"] for loss in run.state()["losses"]] == [2])
        b2 = await _walk_in(run, "b", gate)
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, b2.output[-3000:])
        assert "degraded: ranks [2] lost" in result.reason, result.reason
        _check((a, b, b2), before=[0, 1, 2], after=[0, 1, 3], walk_in=3, exact=True)
        body = run.state()
        assert [(j["rank"], j["host"], j["round"]) for j in body["joins"]] == [(3, "b", GATE)], body["joins"]
        assert {m["host"]: m["link"] for m in body["members"]}["b"] == "closed", body["members"]
        await run.until_no_processes(10)


@pytest.mark.parametrize(
    ("fault", "mode", "cadence"),
    [("exit", "cpu_sync", 1), ("stop", "cpu_sync", 1), ("exit", "cpu_cadence", 2), ("exit", "cpu_async", 1)],
)
async def test_a_rank_lost_on_a_host_that_runs_on_heals_in_as_a_walk_in_of_its_own(
    tmp_path: Path, fault: str, mode: str, cadence: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 of host a is lost before round GATE (tolerance 1, growth to three ranks): it fails on its own
    (`exit`), or hangs (`stop`: SIGSTOP, declared dead by its silence, its stack dumped, killed). Its
    host-mate rank 0 trains on, and a's agent offers the freed slot at once as walk-in host `a+1`
    (flodld/agent/host.py), whose rank 3 rides host a's relay (no relay of its own). Ready while the members
    wait before round GATE, it waits for a round's end (a rider never enters a round its relay may have
    begun): it enters at GATE + 1 with round GATE's averaged state (the mean over ranks 0 and 2), and the
    world is back to three ranks, on two relays, without host a ever leaving the run. `cpu_cadence` and
    `cpu_async` heal the same way at their own round boundaries (cpu_async's results are elastic updates,
    so only their agreement is checked there, not the reference mean).
    """
    caplog.set_level(logging.INFO, logger="flodld.controller.dataplane")
    gate = tmp_path / "gate"
    program = {"HEAL_ROUNDS": str(ROUNDS), "HEAL_GATE_ROUND": str(GATE), "HEAL_GATE": str(gate)}
    if mode != "cpu_sync":
        program.update(HEAL_MODE=mode, HEAL_CADENCE=str(cadence))
    if fault == "exit":
        program["HEAL_EXIT_RANK"] = "1"
    options = _options(bound=3, mode=mode)
    if fault == "stop":  # 5 s of silence (scaled by 0.2): declared dead long before the run's bound
        options = options.model_copy(update={"env": {**options.env, "FLODL_LIVENESS_TIMEOUT_SECS": "25"}})
    async with fault_run(options) as run:
        a = await run.spawn_agent("a", ranks=2, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
        await _until("admission of a", lambda: run.state()["joined_ranks"] >= 2)
        b = await run.spawn_agent("b", ranks=1, program=PROGRAM, **program)  # type: ignore[arg-type]  # env names only
        if fault == "exit":
            await a.wait_for(f"heal-exit rank 1 before round {GATE}", FORMATION_BOUND_SECS)
        else:
            await a.wait_for(f"heal-stall rank 1 before round {GATE}", FORMATION_BOUND_SECS)
            os.kill(run.find(RANK="1").pid, signal.SIGSTOP)
        await _until("a+1's rank ready", lambda: "event=walk_in_ready host=a ranks=[3]" in caplog.text)
        assert [j["round"] for j in run.state()["joins"]] == [None]  # no round ended since: it waits
        gate.touch()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, a.output[-3000:])
        assert "degraded: ranks [1] lost" in result.reason, result.reason
        assert f"rank 3 on 'a+1' in round {GATE + 1}" in result.reason, result.reason
        assert re.search(r"slot cpu:?1 heals in as walk-in host 'a\+1'", a.output), a.output[-3000:]
        assert "its rank(s) ride host 'a''s relay (no relay of its own)" in a.output, a.output[-3000:]
        assert "[a+1:relay]" not in a.output, a.output[-3000:]  # one relay for host a and its healed slot
        _check((a, b), before=[0, 2], after=[0, 2, 3], walk_in=3, exact=mode != "cpu_async", entered=GATE + 1)
        body = run.state()
        joins = [(j["rank"], j["host"], j["round"]) for j in body["joins"]]
        assert joins == [(3, "a+1", GATE + 1)], joins
        (loss,) = body["losses"]
        assert loss["rank"] == 1, loss
        if fault == "stop":
            assert loss["cause"].startswith("declared dead: rank 1 on 'a' sent no heartbeat"), loss
            assert re.search(r'File ".*heal_program\.py", line \d+ in main', a.output), a.output[-3000:]
        await asyncio.wait_for(a.process.wait(), 30)
        assert a.process.returncode == 0, a.output[-3000:]  # one agent process served both hosts, and exits
        await run.until_no_processes(10)


async def test_with_growth_the_tolerance_bounds_the_ranks_missing_not_every_loss(tmp_path: Path) -> None:
    """Tolerance 1 and growth: host b is killed and heals back in (rank 3), then killed again and heals back
    again (rank 4). Two losses over the run, never more than one rank missing at a time: the run finishes
    degraded, its verdict naming both losses and both joins.
    """
    gate, gate2 = tmp_path / "gate", tmp_path / "gate2"
    second = GATE + 2
    gates = {"HEAL_GATE2_ROUND": str(second), "HEAL_GATE2": str(gate2)}
    async with fault_run(_options(bound=3)) as run:
        a, b = await _form(run, gate, **gates)
        b.process.send_signal(signal.SIGKILL)
        await _until("b's loss", lambda: [loss["rank"] for loss in run.state()["losses"]] == [2])
        b2 = await _walk_in(run, "b", gate, **gates)  # rank 3, enters at GATE; the gate opens
        for agent, rank in ((a, 0), (a, 1), (b2, 3)):
            await agent.wait_for(f"heal-stall2 rank {rank} before round {second}", FORMATION_BOUND_SECS)
        b2.process.send_signal(signal.SIGKILL)
        await _until("b's second loss", lambda: [loss["rank"] for loss in run.state()["losses"]] == [2, 3])
        assert run.state()["phase"] == "training", run.state()["reason"]  # one rank missing: within 1
        b3 = await run.spawn_agent("b", ranks=1, program=PROGRAM, HEAL_ROUNDS=str(ROUNDS))
        await _until("b's second entry", lambda: [j["round"] for j in run.state()["joins"]] == [GATE, second])
        gate2.touch()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, b3.output[-3000:])
        assert "degraded: ranks [2, 3] lost: rank 2 on 'b'" in result.reason, result.reason
        assert "ranks [3, 4] healed in: rank 3 on 'b' in round 3; rank 4 on 'b' in round 5" in result.reason
        joins = [(j["rank"], j["host"], j["round"]) for j in run.state()["joins"]]
        assert joins == [(3, "b", GATE), (4, "b", second)], joins
        results: dict[int, list[int]] = {}
        for line in _lines("heal-result", a, b, b2, b3):
            results.setdefault(line["round"], []).append(line["rank"])
        assert sorted(results[second - 1]) == [0, 1, 3] and sorted(results[ROUNDS - 1]) == [0, 1, 4], results
        await run.until_no_processes(10)


async def test_a_walk_in_beyond_the_bound_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Three live ranks of at most three: the walk-in is refused (elastic_full, transient: a persistent joiner
    dials again and gets in once a rank is lost) and starts no rank; the run finishes undisturbed.
    """
    gate = tmp_path / "gate"
    async with fault_run(_options(bound=3)) as run:
        a, b = await _form(run, gate)
        c = await run.spawn_agent("c", ranks=1, program=PROGRAM)
        code = await asyncio.wait_for(c.process.wait(), FORMATION_BOUND_SECS)
        await asyncio.sleep(0.2)
        assert code == 1, (code, c.output[-2000:])  # transient: `fdl join --persist` dials again
        assert "elastic_full" in c.output and "of at most 3 (elastic_max_ranks)" in c.output, c.output[-2000:]
        assert "heal-" not in c.output
        assert run.state()["refused"].get("elastic_full") == 1, run.state()["refused"]
        gate.touch()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, result
        assert run.state()["joins"] == []
        assert len(_lines("heal-result", a, b)) == 3 * ROUNDS
        await run.until_no_processes(10)


async def _spawn_with_args(
    run: Run, host: str, ranks: int, program: Path, args: tuple[str, ...]
) -> AgentProcess:
    """`Run.spawn_agent` with program arguments (the ranks get them too)."""
    spec = AgentSpec(
        host=host,
        controller_host="127.0.0.1",
        controller_port=run.port,
        salt_hex=run.controller.salt_hex,
        devices=[f"cpu:{ranks}" if ranks > 1 else "cpu"],
        averaging=run.controller.options.averaging,
        grace_secs=2.0,
    )
    environ = {**os.environ, **FAST_ENV, MARK: run.mark}
    agent = AgentProcess(host, await start_agent(program, spec, environ, args=args))
    agent.reader = asyncio.get_running_loop().create_task(agent.collect())
    run.agents.append(agent)
    return agent


async def test_the_example_starts_a_walk_in_from_the_averaged_weights_and_reshards() -> None:
    """examples/elastic_training.py as its docstring runs it: host c walks in while a and b train, loads the
    averaged weights at the others' step, and all three reshard over three members and finish.
    """
    example = Path(__file__).resolve().parents[2] / "examples" / "elastic_training.py"
    # up to 40 s of pauses (800 x 0.05 s) for c to start and walk in, loaded; none once it is in
    args = ("--steps", "800", "--pause", "0.05", "--pause-until", "3")
    two = JoinConfig(join_timeout=60, target_ranks=2, min_rank_start=2, elastic_max_ranks=3)
    async with fault_run(_options(bound=3).model_copy(update={"capacity": 2, "join": two})) as run:
        a = await _spawn_with_args(run, "a", 2, example, args)
        await _until("three rounds", lambda: run.controller.run_metrics.rounds >= 3)
        c = await _spawn_with_args(run, "c", 1, example, args)
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert result.verdict is Phase.DONE, (result, c.output[-3000:])
        walked = re.search(r"rank 2: walked in at step (\d+), shard 3 of 3", c.output)
        assert walked is not None and int(walked[1]) >= 3, c.output[-3000:]
        (join,) = run.state()["joins"]
        assert (join["rank"], join["host"], join["round"]) == (2, "c", int(walked[1]))
        for rank in (0, 1):
            assert re.search(rf"rank {rank}: step \d+: members \[0, 1, 2\] \(epoch 1\), my shard", a.output)
        done = r"rank (\d): done after 800 steps, members \[0, 1, 2\], loss (\S+)"
        finals = re.findall(done, a.output + c.output)
        assert sorted(int(rank) for rank, _ in finals) == [0, 1, 2], (a.output[-2000:], c.output[-2000:])
        assert all(float(loss) < 0.01 for _, loss in finals), finals
        await run.until_no_processes(10)
