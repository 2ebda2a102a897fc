"""`flodld serve --max-restarts N`: a failed run is re-formed at once as a fresh world (its persist walk-ins
re-dial), its ranks seeing TORCHELASTIC_RESTART_COUNT; used up, the job fails; then the service goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import PROGRAMS, REPO, Fdl, child_env, free_port, write_discovery_project
from tests.serve import listening_port, serve_argv

pytestmark = pytest.mark.multiproc

SCRIPT = str(PROGRAMS / "checkpoint_resume.py")


def _serve_once(project: Path, *flags: str) -> tuple[subprocess.Popen[str], int, list[str]]:
    daemon = subprocess.Popen(
        serve_argv("--once", *flags, config=project / "fdl.yml", port=None, run_id="job"),
        cwd=REPO,
        env=child_env(FLODL_NET_TIMEOUT_SCALE="0.1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert daemon.stderr is not None
    log: list[str] = []
    for line in daemon.stderr:
        log.append(line)
        if port := listening_port(line):
            threading.Thread(target=lambda: log.extend(daemon.stderr or ()), daemon=True).start()
            return daemon, port, log
    raise AssertionError("flodld serve never listened:\n" + "".join(log))


def _walk_in(port: int, token: str, out: Path, *args: str) -> Fdl:
    return Fdl(
        "join", f"127.0.0.1:{port}", "--persist", "--bin", SCRIPT, "--host", "walk-a", "--devices", "cpu",
        "--", str(out), *args,
        env=child_env(FDL_JOIN_TOKEN=token, FLODL_NET_TIMEOUT_SCALE="0.1", PYTHONPATH=str(REPO)),
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_a_failed_run_is_restarted_once_and_the_script_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = write_discovery_project(tmp_path, free_port(), token, ranks=1)
    out = tmp_path / "out"
    out.mkdir()
    daemon, port, log = _serve_once(project, "--max-restarts", "2")
    walk_in = _walk_in(port, token, out, "8", "2", "5", "0")  # rank 0 SIGKILLs itself at step 5, attempt 0
    try:
        assert daemon.wait(timeout=200) == 0, "".join(log)
    finally:
        walk_in.kill()
        daemon.kill()
    text = "".join(log)
    assert text.count("event=restarting attempt=2 max_attempts=3") == 1, text
    assert "event=restarting attempt=3" not in text
    rows = sorted(
        tuple(int(x) for x in line.split()[:3]) for line in (out / "attempts.txt").read_text().splitlines()
    )
    assert rows == [(0, 0, 1), (0, 1, 5)], rows  # attempt 2 saw TORCHELASTIC_RESTART_COUNT=1, resumed at 5
    assert (out / "final.pt").exists()


@pytest.mark.timeout(240)
def test_used_up_restarts_fail_the_job_after_each_attempt(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = write_discovery_project(tmp_path, free_port(), token, ranks=1)
    out = tmp_path / "out"
    out.mkdir()
    daemon, port, log = _serve_once(project, "--max-restarts", "1")
    # FAULT_STEP 1 with the rank's own restart count ignored: a script that fails on every attempt
    walk_in = _walk_in(port, token, out, "8", "2", "1", "0", "always")
    try:
        assert daemon.wait(timeout=200) == 1, "".join(log)
    finally:
        walk_in.kill()
        daemon.kill()
    text = "".join(log)
    assert text.count("event=restarting attempt=2 max_attempts=2") == 1, text
    assert text.count("event=run_ended") == 2, text
    rows = sorted(
        tuple(int(x) for x in line.split()[:3]) for line in (out / "attempts.txt").read_text().splitlines()
    )
    assert rows == [(0, 0, 1), (0, 1, 1)], rows


@pytest.mark.timeout(240)
def test_state_json_history_and_fdl_status_show_the_attempt_and_the_earlier_ones_cause(
    tmp_path: Path,
) -> None:
    token = secrets.token_hex(16)
    project = write_discovery_project(tmp_path, free_port(), token, ranks=1)
    out = tmp_path / "out"
    out.mkdir()
    daemon = subprocess.Popen(
        serve_argv("--max-restarts", "2", config=project / "fdl.yml", port=None, run_id="job"),
        cwd=REPO, env=child_env(FLODL_NET_TIMEOUT_SCALE="0.1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    port = int(yaml_port(project))
    walk_in = _walk_in(port, token, out, "8", "2", "5", "0")
    try:
        deadline = time.monotonic() + 180
        history: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            history = list((_state(port) or {}).get("history") or [])
            if history and history[0].get("verdict") == "done":
                break
            time.sleep(0.5)
        assert history and history[0]["verdict"] == "done", history
        status = Fdl("status", "--addr", f"127.0.0.1:{port}", "--history")
        assert status.wait() == 0, status.output
    finally:
        walk_in.kill()
        daemon.kill()
        daemon.wait()
    # One entry for the run: its latest attempt, the failed one before it named in attempt.earlier.
    [run] = history
    attempt = run["attempt"]
    assert isinstance(attempt, dict) and attempt["number"] == 2 and attempt["max_attempts"] == 3, attempt
    [earlier] = attempt["earlier"]
    assert earlier["number"] == 1 and earlier["run_id"] != run["run_id"] and earlier["hosts"] == ["walk-a"]
    assert "ranks failed" in str(earlier["cause"]), earlier
    assert "[attempt 2/3]" in status.output and "[attempt 1/3]" not in status.output, status.output
    assert "after attempt 1 failed: " in status.output, status.output


def yaml_port(project: Path) -> str:
    return next(
        line.split(":")[1].strip()
        for line in (project / "fdl.yml").read_text().splitlines()
        if "port:" in line
    )


def _state(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as reply:
            state: dict[str, Any] = json.loads(reply.read())
            return state
    except (urllib.error.URLError, ConnectionError):
        return None


# --- restarts that keep the join links (Reform / Stopped, docs/restarts.md) ---------------------------

PROBE = str(PROGRAMS / "reform_probe.py")


def _reform_project(tmp_path: Path, token: str, *, quorum: int, target: int, extra: str = "") -> Path:
    project = write_discovery_project(tmp_path, free_port(), token, ranks=target, join_timeout=4)
    config = project / "fdl.yml"
    text = config.read_text().replace(f"min_rank_start: {target}\n", f"min_rank_start: {quorum}\n")
    config.write_text(text.replace("join_timeout: 4\n", "join_timeout: 4\n" + extra))
    return project


def _plain_walk_in(port: int, token: str, out: Path, host: str) -> Fdl:
    """`fdl join` without --persist: it ends with its agent, so only a kept link takes it past attempt 1."""
    return Fdl(
        "join", f"127.0.0.1:{port}", "--bin", PROBE, "--host", host, "--devices", "cpu", "--", str(out), host,
        env=child_env(FDL_JOIN_TOKEN=token, FLODL_NET_TIMEOUT_SCALE="0.1", PYTHONPATH=str(REPO)),
    )  # fmt: skip


def _rows(out: Path) -> list[tuple[int, int, int, int, str]]:
    path = out / "attempts.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted((int(a), int(b), int(c), int(d), e) for a, b, c, d, e in (line.split() for line in lines))


def _wait_rows(out: Path, count: int, daemon: subprocess.Popen[str], log: list[str]) -> None:
    deadline = time.monotonic() + 150
    while len(_rows(out)) < count:
        assert time.monotonic() < deadline and daemon.poll() is None, "".join(log)
        time.sleep(0.2)


def _kill_host(walk_in: Fdl) -> None:
    """SIGKILL the host: its `fdl join`, agent, relay and ranks (one session), as a lost box."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(walk_in.process.pid, signal.SIGKILL)
    walk_in.process.wait()


@pytest.mark.timeout(240)
def test_a_killed_host_is_left_out_and_the_survivor_keeps_its_link_and_agent(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = _reform_project(tmp_path, token, quorum=1, target=2)
    out = tmp_path / "out"
    out.mkdir()
    daemon, port, log = _serve_once(project, "--max-restarts", "1")
    a, b = _plain_walk_in(port, token, out, "walk-a"), _plain_walk_in(port, token, out, "walk-b")
    try:
        _wait_rows(out, 2, daemon, log)
        _kill_host(b)
        assert daemon.wait(timeout=150) == 0, "".join(log)
        assert a.process.wait(timeout=30) == 0, a.output
    finally:
        for walk_in in (a, b):
            walk_in.kill()
        daemon.kill()
    text = "".join(log)
    assert text.count("event=restarting attempt=2 max_attempts=2") == 1, text
    assert "event=host_kept host=walk-a" in text and "kept=1 readmitted=1" in text, text
    rows = _rows(out)
    first_a = next(row for row in rows if row[0] == 0 and row[4] == "walk-a")
    assert [row for row in rows if row[0] == 1] == [(1, 0, 1, first_a[3], "walk-a")], rows  # the same agent
    assert "staying linked for the next attempt" in a.output, a.output


@pytest.mark.timeout(240)
def test_a_walk_in_dialing_during_the_reformation_window_joins_the_kept_host(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = _reform_project(tmp_path, token, quorum=2, target=2)
    out = tmp_path / "out"
    out.mkdir()
    daemon, port, log = _serve_once(project, "--max-restarts", "1")
    a, b = _plain_walk_in(port, token, out, "walk-a"), _plain_walk_in(port, token, out, "walk-b")
    c: Fdl | None = None
    try:
        _wait_rows(out, 2, daemon, log)
        _kill_host(b)
        c = _plain_walk_in(port, token, out, "walk-c")  # a replacement box, dialing as the run re-forms
        assert daemon.wait(timeout=150) == 0, "".join(log)
        assert a.process.wait(timeout=30) == 0 and c.process.wait(timeout=30) == 0, a.output + c.output
    finally:
        for walk_in in (a, b, c):
            if walk_in is not None:
                walk_in.kill()
        daemon.kill()
    rows = _rows(out)
    first_a = next(row for row in rows if row[0] == 0 and row[4] == "walk-a")
    second = [row for row in rows if row[0] == 1]
    assert sorted((rank, world, host) for _, rank, world, _, host in second) in (
        [(0, 2, "walk-a"), (1, 2, "walk-c")],
        [(0, 2, "walk-c"), (1, 2, "walk-a")],
    ), rows  # contiguous ranks over the kept host and the walk-in
    assert next(row for row in second if row[4] == "walk-a")[3] == first_a[3], rows  # walk-a's same agent


@pytest.mark.timeout(240)
def test_below_quorum_after_the_reformation_window_fails_with_each_attempts_cause(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = _reform_project(tmp_path, token, quorum=2, target=2, extra="      max_join_timeout: 6\n")
    out = tmp_path / "out"
    out.mkdir()
    daemon, port, log = _serve_once(project, "--max-restarts", "1")
    a, b = _plain_walk_in(port, token, out, "walk-a"), _plain_walk_in(port, token, out, "walk-b")
    try:
        _wait_rows(out, 2, daemon, log)
        _kill_host(b)
        assert daemon.wait(timeout=150) == 1, "".join(log)
        a.process.wait(timeout=30)  # the run is over: its kept link is closed
    finally:
        for walk_in in (a, b):
            walk_in.kill()
        daemon.kill()
    text = "".join(log)
    assert "kept=1 readmitted=1" in text, text
    assert re.search(r"event=run_failed reason='quorum not met: 1 of 2 ranks joined", text), text
    assert re.search(r"event=restarting attempt=2 max_attempts=2 after=\".*walk-b", text) or re.search(
        r"event=restarting attempt=2 max_attempts=2 after='.*walk-b", text
    ), text
    assert [row[0] for row in _rows(out)] == [0, 0], _rows(out)  # attempt 2 never formed
