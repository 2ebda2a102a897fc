"""`FanOut` reports every agent's end exactly once, to the fan-out that holds the agent at that moment.

The run supervisor concludes an attempt only when every agent's end is known, so an end that is never
reported holds the run (CI once saw a fan-out wait five minutes after its verdict without a word). The
sessions here are stand-ins with the two behaviours that matter: a wait that ends, and one that never
does (its watcher is cancelled by `stop()`); the real sessions are in test_launcher.py and
test_fanout_restarts.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

from flodld.fanout.launcher import AgentExit, FanOut
from flodld.fanout.ssh import RemoteAgent


@dataclass
class _Process:
    exit_status: int | None = None


@dataclass
class _Session:
    """A session whose `wait()` returns `code` once `ended` is set, or never."""

    code: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    process: _Process = field(default_factory=_Process)
    lost: bool = False
    stops: int = 0

    async def wait(self) -> int:
        await self.ended.wait()
        return self.code

    async def stop(self, *, timeout: float = 15.0) -> None:
        self.stops += 1


def _fan_out(reports: list[AgentExit], sessions: dict[str, _Session]) -> FanOut:
    fan = FanOut([], grace_s=0, on_exit=reports.append)
    fan.watch_grace_s = 0.05
    for host, session in sessions.items():
        fan.adopt(host, cast(RemoteAgent, session))
    return fan


async def test_stop_reports_an_agent_whose_session_never_said_how_it_ended() -> None:
    reports: list[AgentExit] = []
    fan = _fan_out(reports, {"a": _Session(code=0), "b": _Session()})
    fan.agents["a"].ended.set()  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert reports == [AgentExit("a", 0)]
    await fan.stop()  # b's wait never ends: its watcher is cancelled after the grace, and b reported
    assert reports == [AgentExit("a", 0), AgentExit("b", 255)]
    await fan.stop()  # idempotent: nobody is reported twice
    assert len(reports) == 2


async def test_stop_reports_the_exit_status_a_session_did_carry() -> None:
    reports: list[AgentExit] = []
    session = _Session()
    session.process.exit_status = 3
    fan = _fan_out(reports, {"a": session})
    await fan.stop()
    assert reports == [AgentExit("a", 3)]


async def test_a_handed_over_agent_is_reported_by_the_fan_out_that_holds_it_and_only_there() -> None:
    old_reports: list[AgentExit] = []
    new_reports: list[AgentExit] = []
    session = _Session(code=1)
    old = _fan_out(old_reports, {"a": session})
    new = FanOut([], grace_s=0, on_exit=new_reports.append)
    new.watch_grace_s = old.watch_grace_s
    old.hand_over(["a"], new)
    await old.stop()  # a is not old's any more: nothing stopped, nothing reported there
    assert session.stops == 0 and old_reports == []
    session.ended.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert new_reports == [AgentExit("a", 1)] and old_reports == []
    await new.stop()
    assert new_reports == [AgentExit("a", 1)]


async def test_stop_leaves_the_kept_agents_running_and_unreported() -> None:
    reports: list[AgentExit] = []
    kept, stopped = _Session(), _Session()
    fan = _fan_out(reports, {"kept": kept, "stopped": stopped})
    await fan.stop(keep=["kept"])  # a restart that keeps "kept" linked
    assert (kept.stops, stopped.stops) == (0, 1)
    assert reports == [AgentExit("stopped", 255)]
    kept.ended.set()  # the kept agent's end is still reported, once, when it comes
    for _ in range(3):
        await asyncio.sleep(0)
    assert reports == [AgentExit("stopped", 255), AgentExit("kept", 0)]
