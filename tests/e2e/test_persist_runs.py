"""One `flodld serve`, two `fdl join --persist` walk-ins, three successive runs.

No operator step between them.
"""

from __future__ import annotations

import json
import secrets
import signal
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


def state(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        assert error.code == 503, error  # only before the first window opens
        return None


def test_two_persist_walk_ins_carry_three_successive_runs_of_one_daemon(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    project = write_discovery_project(tmp_path, free_port(), token, ranks=2, join_timeout=300)
    env = child_env(FLODL_NET_TIMEOUT_SCALE="0.1")
    daemon = subprocess.Popen(
        serve_argv(config=project / "fdl.yml", port=None, run_id="persist"),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert daemon.stderr is not None
    log: list[str] = []
    port = 0
    for line in daemon.stderr:
        log.append(line)
        port = listening_port(line) or 0
        if port:
            break
    assert port, "".join(log)
    threading.Thread(
        target=lambda: log.extend(daemon.stderr or ()), daemon=True
    ).start()  # never let the pipe fill
    join_env = child_env(FDL_JOIN_TOKEN=token, FLODL_NET_TIMEOUT_SCALE="0.1")
    program = str(PROGRAMS / "persist_step.py")
    walk_ins = [
        Fdl(
            "join",
            f"127.0.0.1:{port}",
            "--persist",
            "--bin",
            program,
            "--host",
            host,
            "--devices",
            "cpu",
            env=join_env,
        )
        for host in ("walk-a", "walk-b")
    ]
    try:
        deadline = time.monotonic() + 420
        current: dict[str, object] | None = None
        while time.monotonic() < deadline:
            current = state(port)
            history = (current or {}).get("history") or []
            assert isinstance(history, list)
            if len(history) >= 3:
                break
            for walk_in in walk_ins:
                assert walk_in.process.poll() is None, f"a persist loop gave up:\n{walk_in.output[-3000:]}"
            time.sleep(0.5)
        assert current is not None
        history = current["history"]
        assert isinstance(history, list) and len(history) >= 3, (
            current,
            [w.output[-2000:] for w in walk_ins],
        )
        oldest_first = list(reversed(history))[:3]
        assert [h["run_id"] for h in oldest_first] == ["persist-1", "persist-2", "persist-3"]
        assert [h["verdict"] for h in oldest_first] == ["done", "failed", "done"], oldest_first
        failed = oldest_first[1]
        assert {"rank": 1, "code": 3} in failed["rank_exits"], failed
        assert "ranks failed" in failed["reason"], failed
        for entry in (oldest_first[0], oldest_first[2]):
            assert entry["ranks"] == 2 and sorted(entry["hosts"]) == ["walk-a", "walk-b"], entry
            assert all(exit_["code"] == 0 for exit_ in entry["rank_exits"]), entry
        # The walk-ins walked from one run into the next on their own, and are still there for the fourth.
        for walk_in in walk_ins:
            assert walk_in.process.poll() is None
            # (its line may follow the run's end in the history by a moment on a loaded machine)
            walk_in.wait_for(r"re-dialing in", timeout=60, count=3)
            # Each run's rank was forked by the loop's one fork server (torch loaded once), rank 1's failing
            # fork of the second run included; none started cold.
            assert walk_in.output.count("forked by this host's fork server") >= 3, walk_in.output[-3000:]
            assert "starting it cold" not in walk_in.output, walk_in.output[-3000:]
        status = Fdl("status", "--addr", f"127.0.0.1:{port}", "--history")
        assert status.wait() == 0, status.output
        assert "persist-2" in status.output and "failed" in status.output, status.output
        print(status.output)  # the table quoted in docs/controller.md
        assert daemon.poll() is None, "the service exited"
    finally:
        for walk_in in walk_ins:
            walk_in.signal(signal.SIGTERM)
        daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(30)
        finally:
            if daemon.poll() is None:
                daemon.kill()
            for walk_in in walk_ins:
                walk_in.kill()
    assert code == 0, "".join(log[-50:])
