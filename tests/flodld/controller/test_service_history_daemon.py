"""Issue 33, point 4: `flodld serve --state-dir` keeps its run history across restarts — a SIGTERM stop
and a kill -9 — and `GET /state.json` and `fdl status --history` show the earlier runs afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flodld.controller.historyfile import HISTORY_NAME, TEMP_NAME
from tests.clients.fdl_proc import fdl
from tests.flodld.controller.test_service_daemon import eventually_state, one_host_run
from tests.reliability.daemon import http_raw, http_request, status_of
from tests.reliability.process import DaemonProcess

pytestmark = pytest.mark.multiproc


def start(tmp_path: Path, state_dir: Path, name: str) -> DaemonProcess:
    config_dir = tmp_path / name
    config_dir.mkdir()
    return DaemonProcess(config_dir, target=1, min_ranks=1, extra=("--state-dir", str(state_dir)))


def ids(body: dict[str, object]) -> list[str]:
    history = body["history"]
    assert isinstance(history, list)
    return [entry["run_id"] for entry in history]


def on_disk(state_dir: Path) -> list[str]:
    path = state_dir / HISTORY_NAME
    if not path.exists():
        return []
    return [json.loads(line)["run_id"] for line in path.read_text().splitlines()[1:]]


async def runs(daemon: DaemonProcess, count: int) -> list[str]:
    """COUNT one-host runs (each fails once its host leaves: a verdict all the same); their run ids."""
    done: list[str] = []
    for _ in range(count):
        current = await eventually_state(daemon.port, lambda s: s["phase"] == "waiting")
        await one_host_run(daemon.port, daemon.token, f"h{len(done)}")
        run_id: str = current["run_id"]

        def recorded(body: dict[str, Any], run_id: str = run_id) -> bool:
            return run_id in ids(body)

        await eventually_state(daemon.port, recorded)
        done.append(run_id)
    return done


async def test_history_survives_sigterm_and_kill_9(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    loop = asyncio.get_running_loop()
    first = start(tmp_path, state_dir, "first")
    try:
        earlier = await runs(first, 2)
        aborted = (await eventually_state(first.port, lambda s: s["phase"] == "waiting"))["run_id"]
        assert await loop.run_in_executor(None, first.terminate) == 0  # aborts the open window: a 3rd run
    finally:
        first.kill()
    assert on_disk(state_dir) == [aborted, *reversed(earlier)]
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / HISTORY_NAME).stat().st_mode) == 0o600

    second = start(tmp_path, state_dir, "second")
    try:
        body = await eventually_state(second.port, lambda s: s["phase"] == "waiting")
        assert ids(body) == [aborted, *reversed(earlier)]  # before any run of this daemon
        assert body["service"]["history_file"] == str(state_dir / HISTORY_NAME)
        assert body["service"]["history_error"] is None
        assert "event=history_loaded" in second.wait_for_line("event=history_loaded")
        code, out, err = await fdl("status", "--addr", f"127.0.0.1:{second.port}", "--history")
        assert code == 0, err
        for run_id in [aborted, *earlier]:
            assert run_id in out
        page = await http_raw(second.port, http_request("GET", "/status"))
        assert status_of(page) == 200 and aborted.encode() in page and earlier[0].encode() in page
        later = await runs(second, 1)
        await loop.run_in_executor(None, lambda: wait_until(lambda: on_disk(state_dir)[:1] == later))
        second.proc.kill()  # kill -9: no goodbye, no last write
        second.proc.wait(10)
    finally:
        second.kill()

    third = start(tmp_path, state_dir, "third")
    try:
        body = await eventually_state(third.port, lambda s: s["phase"] == "waiting")
        assert ids(body) == [*later, aborted, *reversed(earlier)]
        assert body["service"]["runs_started"] == 1  # counts are this daemon's; the history is the disk's
        assert await loop.run_in_executor(None, third.terminate) == 0
        assert "Traceback" not in third.log
    finally:
        third.kill()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


async def test_the_history_is_bounded_by_history_runs(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    daemon = start(tmp_path, state_dir, "cfg")
    try:
        config = daemon.config.read_text().replace("  controller:\n", "  controller:\n    history_runs: 2\n")
        daemon.config.write_text(config)
        daemon.proc.send_signal(signal.SIGHUP)
        await eventually_state(daemon.port, lambda s: s["service"]["history_limit"] == 2)
        done = await runs(daemon, 3)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_until(lambda: on_disk(state_dir)[:1] == done[-1:])
        )
        assert on_disk(state_dir) == [done[2], done[1]]
    finally:
        daemon.kill()


async def test_a_damaged_or_newer_history_never_stops_the_daemon(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / TEMP_NAME).write_text('{"format": "flodld-history"')  # a crash mid-write
    good = {
        "run_id": "old-1",
        "verdict": "done",
        "reason": "ok",
        "started_at": 1.0,
        "formed_at": 2.0,
        "ended_at": 3.0,
        "ranks": 1,
        "hosts": ["a"],
        "host_count": 1,
        "rank_exits": [],
    }
    (state_dir / HISTORY_NAME).write_text(
        '{"format": "flodld-history", "version": 1}\n' + json.dumps(good) + '\n{"run_id": "old-0", "verd'
    )
    daemon = start(tmp_path, state_dir, "damaged")
    try:
        body = await eventually_state(daemon.port, lambda s: s["phase"] == "waiting")
        assert ids(body) == ["old-1"]
        error = body["service"]["history_error"]
        assert str(state_dir / HISTORY_NAME) in error and "line 3: cut off" in error
        assert "event=history_damaged" in daemon.wait_for_line("event=history_damaged")
        assert not (state_dir / TEMP_NAME).exists()
        assert (state_dir / "history.jsonl.damaged").exists()
        assert await asyncio.get_running_loop().run_in_executor(None, daemon.terminate) == 0
    finally:
        daemon.kill()
    assert on_disk(state_dir)[1:] == ["old-1"]  # the SIGTERM-aborted window, then the intact record

    newer = b'{"format": "flodld-history", "version": 7}\n{"whatever": true}\n'
    (state_dir / HISTORY_NAME).write_bytes(newer)
    daemon = start(tmp_path, state_dir, "newer")
    try:
        body = await eventually_state(daemon.port, lambda s: s["phase"] == "waiting")
        assert ids(body) == []
        assert "newer flodld" in body["service"]["history_error"]
        assert "event=history_refused" in daemon.wait_for_line("event=history_refused")
        await runs(daemon, 1)
        assert await asyncio.get_running_loop().run_in_executor(None, daemon.terminate) == 0
    finally:
        daemon.kill()
    assert (state_dir / HISTORY_NAME).read_bytes() == newer  # never overwritten


async def test_systemd_state_directory_is_used_without_the_flag(tmp_path: Path) -> None:
    state_dir = tmp_path / "systemd-state"
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    saved = dict(os.environ)
    os.environ["STATE_DIRECTORY"] = str(state_dir)
    try:
        daemon = DaemonProcess(config_dir, target=1, min_ranks=1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        body = await eventually_state(daemon.port, lambda s: s["phase"] == "waiting")
        assert body["service"]["history_file"] == str(state_dir / HISTORY_NAME)
        # a second daemon on the same state directory is refused before it binds
        other = await asyncio.create_subprocess_exec(
            *daemon.argv,
            "--state-dir",
            str(state_dir),
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        _, err = await asyncio.wait_for(other.communicate(), 30)
        assert other.returncode == 2 and "in use by another flodld serve" in err.decode()
        assert await asyncio.get_running_loop().run_in_executor(None, daemon.terminate) == 0
    finally:
        daemon.kill()
    assert len(on_disk(state_dir)) == 1
