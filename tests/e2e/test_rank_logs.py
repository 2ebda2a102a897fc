"""Per-rank log files (issue 33, point 2): `fdl run`/`fdl join` --log-dir with torchrun's --redirects and
--tee, one stdout.log/stderr.log per run, attempt, host and rank on the host that ran it; `fdl logs`.
"""

from __future__ import annotations

import re
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import PROGRAMS, REPO, Fdl, child_env, free_port, write_discovery_project

pytestmark = pytest.mark.multiproc

PROGRAM = str(PROGRAMS / "two_streams.py")


def rank_files(base: Path) -> dict[tuple[int, int, str], str]:
    """{(attempt, rank, stream): text} of every log file under `base` (one run, one host)."""
    (run,) = [entry for entry in base.iterdir() if entry.is_dir()]
    found: dict[tuple[int, int, str], str] = {}
    for path in run.glob("attempt_*/*/rank_*/*.log"):
        attempt, rank = int(path.parts[-4].split("_")[1]), int(path.parts[-2].split("_")[1])
        found[(attempt, rank, path.stem)] = path.read_text()
    return found


def rank_lines(output: str) -> list[str]:
    """The rank output lines on the terminal (the agent's `[host:device:rN] ` prefix)."""
    return [line for line in output.splitlines() if re.match(r"^\[[^\]]*:r\d+\] ", line)]


def test_redirects_3_leaves_each_ranks_streams_in_its_files_and_none_on_the_terminal(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = Fdl("run", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3", PROGRAM)
    assert run.wait() == 0, run.output
    assert rank_lines(run.output) == [], run.output
    assert rank_files(logs) == {
        (0, rank, stream): f"{stream[3:]} rank={rank} attempt=0\n"
        for rank in (0, 1)
        for stream in ("stdout", "stderr")
    }
    for path in [logs, *logs.rglob("*")]:  # rank output may be sensitive: 0700 directories, 0600 files
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert re.search(r"rank logs under .*/attempt_0", run.output), run.output


def test_tee_3_writes_the_files_and_keeps_the_prefixed_lines_on_the_terminal(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = Fdl("run", "--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3", PROGRAM)
    assert run.wait() == 0, run.output
    assert sorted(rank_lines(run.output)) == [
        f"[127.0.0.1:cpu:{rank}:r{rank}] {kind} rank={rank} attempt=0"
        for rank in (0, 1)
        for kind in ("err", "out")
    ], run.output
    files = rank_files(logs)
    assert (
        files[(0, 1, "stdout")] == "out rank=1 attempt=0\n"
        and files[(0, 1, "stderr")] == "err rank=1 attempt=0\n"
    )


def test_per_local_rank_form_redirects_only_what_it_names(tmp_path: Path) -> None:
    # -r 0:1 (local rank 0's stdout to its file, off the terminal), -t 1:2 (local rank 1's stderr teed).
    logs = tmp_path / "logs"
    run = Fdl("run", "--nproc-per-node", "2", "--log-dir", str(logs), "-r", "0:1", "-t", "1:2", PROGRAM)
    assert run.wait() == 0, run.output
    assert sorted(rank_lines(run.output)) == [
        "[127.0.0.1:cpu:0:r0] err rank=0 attempt=0",
        "[127.0.0.1:cpu:1:r1] err rank=1 attempt=0",
        "[127.0.0.1:cpu:1:r1] out rank=1 attempt=0",
    ], run.output
    assert rank_files(logs) == {
        (0, 0, "stdout"): "out rank=0 attempt=0\n",
        (0, 1, "stderr"): "err rank=1 attempt=0\n",
    }


def test_each_restart_attempt_writes_its_own_files_under_the_same_run(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = Fdl(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs), "--redirects", "3",
        PROGRAM, "--fail-first-attempt",
    )  # fmt: skip
    assert run.wait() == 0, run.output
    assert "restarting: attempt 2 of at most 2 (restart 1)" in run.output, run.output
    files = rank_files(logs)  # one run directory, both attempts in it
    for attempt in (0, 1):
        for rank in (0, 1):
            assert files[(attempt, rank, "stdout")] == f"out rank={rank} attempt={attempt}\n", files
            assert files[(attempt, rank, "stderr")] == f"err rank={rank} attempt={attempt}\n", files


def fdl_logs(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "fdl.main", "logs", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)


def test_fdl_logs_shows_one_ranks_files_of_the_latest_run_and_follows_them(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = Fdl("run", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3", PROGRAM)
    assert run.wait() == 0, run.output
    shown = fdl_logs("--log-dir", str(logs), "--rank", "1")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "[127.0.0.1:r1:stdout] out rank=1 attempt=0",
        "[127.0.0.1:r1:stderr] err rank=1 attempt=0",
    ]
    alone = fdl_logs("--log-dir", str(logs), "--rank", "1", "--stream", "stderr")
    assert alone.stdout == "err rank=1 attempt=0\n", alone
    missing = fdl_logs("--log-dir", str(logs), "--rank", "7")
    assert missing.returncode == 1 and "no log file in" in missing.stderr and "--rank 7" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = fdl_logs("--log-dir", str(empty))
    assert nothing.returncode == 1 and f"no rank logs in {empty}" in nothing.stderr, nothing.stderr
    (stdout_log,) = logs.glob("*/attempt_0/*/rank_1/stdout.log")
    follow = Fdl("logs", "--log-dir", str(logs), "--rank", "1", "--stream", "stdout", "--follow")
    try:
        follow.wait_for(r"^out rank=1 attempt=0$", timeout=30)
        with stdout_log.open("a") as appended:
            appended.write("later line\n")
        follow.wait_for(r"^later line$", timeout=30)
    finally:
        follow.process.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0, follow.output


def test_a_walk_in_writes_its_ranks_logs_on_its_own_side(tmp_path: Path) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(
        tmp_path, port, token, ranks=2
    )  # a controller with no worker of its own
    controller_logs, walk_logs = tmp_path / "controller-logs", tmp_path / "walk-logs"
    controller = Fdl(
        "run", "--project", str(project), "--log-dir", str(controller_logs), "--tee", "3", PROGRAM
    )
    controller.wait_for(r"waiting — window open")
    walk_dir = tmp_path / "walk"
    walk_dir.mkdir()
    walk_in = Fdl(
        "join", f"127.0.0.1:{port}", "--bin", PROGRAM, "--host", "walk-a", "--devices", "cpu:2",
        "--log-dir", str(walk_logs), "--redirects", "3",
        cwd=walk_dir, env=child_env(FDL_JOIN_TOKEN=token),
    )  # fmt: skip
    try:
        assert walk_in.wait() == 0, walk_in.output
        assert controller.wait() == 0, controller.output
    finally:
        walk_in.kill()
        controller.kill()
    assert rank_lines(walk_in.output) == [], walk_in.output
    (run,) = walk_logs.iterdir()
    for rank in (0, 1):
        assert (
            run / "attempt_0" / "walk-a" / f"rank_{rank}" / "stdout.log"
        ).read_text() == f"out rank={rank} attempt=0\n"
    assert not any(controller_logs.rglob("*.log"))  # the controller's host ran no rank: nothing written there
