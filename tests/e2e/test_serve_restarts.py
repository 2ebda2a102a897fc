"""`flodld serve --max-restarts N`: a failed run is re-formed at once as a fresh world (its persist walk-ins
re-dial), its ranks seeing TORCHELASTIC_RESTART_COUNT; used up, the job fails; then the service goes on.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

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


def _state(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]
    except (urllib.error.URLError, ConnectionError):
        return None
