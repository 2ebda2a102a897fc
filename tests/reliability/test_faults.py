"""Faults with real agents, relays and gloo ranks on 127.0.0.1: each asserts the documented outcome within a
stated bound, that every process of the run is gone afterwards, and that state.json still lists every rank.

Bounds (with FLODL_NET_TIMEOUT_SCALE=0.2, 2 s agent grace):
- a join link lost before formation: the host's ranks are retracted within RETRACT_BOUND_SECS;
- a process killed after formation: the run fails, naming the host or rank, within FAIL_BOUND_SECS, and no
  process of the run is left ORPHAN_BOUND_SECS after the verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import pytest

from flodld.membership.phase import Phase
from flodld.relay.spec import RELAY_ENV

from .workers import fault_run

pytestmark = pytest.mark.multiproc

RETRACT_BOUND_SECS = 2.0
FAIL_BOUND_SECS = 10.0
ORPHAN_BOUND_SECS = 5.0
FORMATION_BOUND_SECS = 60.0  # two torch imports on a loaded 2-core machine


async def _until(predicate: object, bound: float, what: str) -> float:
    begun = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - begun > bound:
            raise AssertionError(f"{what} did not happen within {bound}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - begun


async def test_agent_killed_before_formation_has_its_ranks_retracted_within_the_bound() -> None:
    async with fault_run() as run:
        agent = await run.spawn_agent("early", ranks=1)
        await _until(lambda: run.state()["joined_ranks"] == 1, 20, "the agent's join")
        agent.process.send_signal(signal.SIGKILL)
        took = await _until(lambda: run.state()["joined_ranks"] == 0, RETRACT_BOUND_SECS, "retraction")
        body = run.state()
        assert body["phase"] == "waiting" and body["members"] == []
        assert run.controller.phase is Phase.WAITING
        await run.until_no_processes(ORPHAN_BOUND_SECS)
        print(f"retracted {took:.2f}s after SIGKILL")


async def test_rank_killed_mid_collective_fails_the_run_naming_it_and_leaves_no_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with fault_run() as run:
        agent = await run.spawn_agent("solo", ranks=2)
        await agent.wait_for("fault-rank 1 step 3", FORMATION_BOUND_SECS)
        secret = run.controller.salt_hex
        processes = run.processes()
        assert len(processes) == 4, [p.cmdline for p in processes]  # agent, relay, two ranks
        for process in processes:
            assert secret.encode() not in process.cmdline.lower(), (
                f"the salt is in the argv of {process.cmdline!r}"
            )
        victim = run.find(RANK="1")
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        result = await asyncio.wait_for(run.controller.wait(), FAIL_BOUND_SECS)
        assert result.verdict is Phase.FAILED
        assert "1" in result.reason, result.reason
        body = run.state()
        assert {"rank": 1, "code": -9} in body["rank_exits"], body["rank_exits"]
        assert body["joined_ranks"] == 2 and body["members"][0]["ranks"] == [0, 1]
        await run.until_no_processes(ORPHAN_BOUND_SECS)
        assert await asyncio.wait_for(agent.process.wait(), 5) != 0
        for text in (agent.output, caplog.text, json.dumps(body)):
            assert secret not in text.lower()
        print(f"failed {time.monotonic() - killed_at:.2f}s after the rank's SIGKILL: {result.reason}")


async def test_relay_killed_tears_the_host_down_and_fails_the_run() -> None:
    async with fault_run() as run:
        agent = await run.spawn_agent("relayed", ranks=2)
        await agent.wait_for("fault-rank 0 step 3", FORMATION_BOUND_SECS)
        relay = next(p for p in run.processes() if RELAY_ENV in p.environ)
        os.kill(relay.pid, signal.SIGKILL)
        result = await asyncio.wait_for(run.controller.wait(), FAIL_BOUND_SECS)
        assert result.verdict is Phase.FAILED, result
        body = run.state()
        # The first non-zero exit decides the verdict; later reports may arrive after it.
        assert body["rank_exits"] and all(e["code"] != 0 for e in body["rank_exits"]), body["rank_exits"]
        assert body["joined_ranks"] == 2 and body["members"][0]["ranks"] == [0, 1]
        await run.until_no_processes(ORPHAN_BOUND_SECS)
        assert "relay" in agent.output


@pytest.mark.parametrize("moment", ["formation", "training"])
async def test_agent_killed_after_the_window_closed_fails_the_run_naming_the_host(moment: str) -> None:
    async with fault_run() as run:
        doomed = await run.spawn_agent("doomed", ranks=1)
        survivor = await run.spawn_agent("survivor", ranks=1)
        if moment == "formation":
            await doomed.wait_for("world formed", FORMATION_BOUND_SECS)
        else:
            await doomed.wait_for("fault-rank", FORMATION_BOUND_SECS)
        doomed.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        result = await asyncio.wait_for(run.controller.wait(), FAIL_BOUND_SECS)
        assert result.verdict is Phase.FAILED
        assert "doomed" in result.reason, result.reason
        body = run.state()
        assert body["joined_ranks"] == 2
        assert {m["host"]: m["link"] for m in body["members"]}["doomed"] == "lost"
        await run.until_no_processes(ORPHAN_BOUND_SECS)
        # The process is gone (checked above); wait() only collects the status asyncio may not have reaped
        # yet.
        survivor_code = await asyncio.wait_for(survivor.process.wait(), ORPHAN_BOUND_SECS)
        assert survivor_code != 0
        print(f"{moment}: failed {time.monotonic() - killed_at:.2f}s after SIGKILL: {result.reason}")


async def test_an_abort_during_the_group_rank_wait_tears_the_host_down_at_once() -> None:
    """In a world of several hosts an agent works out torchrun's GROUP_RANK in the run's store before its
    ranks start, waiting up to 10 s for every host to publish. A run that fails meanwhile must not hold the
    host's teardown for that wait: here the other host (a protocol-level agent) never publishes and drops
    its link with its rank unreported; the controller fails the run and aborts the real agent, which must
    end, with every process of the run, within the orphan bound — not after the 10 s store wait (CI caught
    the agent still waiting, and counted it an orphan).
    """
    from tests.flodld.controller.agents import join

    async with fault_run() as run:
        survivor = await run.spawn_agent("survivor", ranks=1)
        ghost = await join(run.port, run.controller.salt, "ghost")
        assert ghost.accepted
        await ghost.world(timeout=FORMATION_BOUND_SECS)
        await survivor.wait_for("world formed", FORMATION_BOUND_SECS)
        await asyncio.sleep(0.5)  # the survivor is in its GROUP_RANK wait: the ghost never publishes
        await ghost.stream.aclose()  # its rank unreported: the host is lost, the run fails
        result = await asyncio.wait_for(run.controller.wait(), FAIL_BOUND_SECS)
        verdict_at = time.monotonic()
        assert result.verdict is Phase.FAILED and "ghost" in result.reason, result.reason
        await run.until_no_processes(ORPHAN_BOUND_SECS)
        assert time.monotonic() - verdict_at < ORPHAN_BOUND_SECS
        await asyncio.wait_for(survivor.process.wait(), ORPHAN_BOUND_SECS)
        assert "abort from the controller" in survivor.output, survivor.output[-3000:]
