"""The root cause across two hosts (issue 33.1): `fdl run` (the controller, no local worker) and two walk-in
`fdl join` hosts on loopback. Rank 1 (host walk-a) raises while every other rank blocks in a collective; the
failure reaches the peers as gloo errors and SIGTERMs, reported in whatever order. Every repetition must name
rank 1 on walk-a with its exception, never a rank torn down by the teardown, and no secret in the tail.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.harness import PROGRAMS, Fdl, child_env, free_port, write_discovery_project

pytestmark = pytest.mark.multiproc

REPEATS = 5
HEADER = "Root cause (first observed failure):"


def _members(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as reply:
        return [str(member["host"]) for member in json.loads(reply.read()).get("members", [])]


def _one_run(tmp_path: Path, index: int, args: list[str]) -> tuple[str, str]:
    """`fdl run`'s output and the secret the ranks saw."""
    port, token, secret = free_port(), secrets.token_hex(16), secrets.token_hex(12)
    directory = tmp_path / f"run{index}"
    directory.mkdir()
    project = write_discovery_project(directory, port, token, ranks=4)
    program = str(PROGRAMS / "root_cause.py")
    run = Fdl("run", "--project", str(project), program, *args)
    walk_ins: list[Fdl] = []
    try:
        run.wait_for(r"waiting — window open")
        env = child_env(FDL_JOIN_TOKEN=token, ROOT_CAUSE_TEST_TOKEN=secret)
        for host in ("walk-a", "walk-b"):  # in this order: walk-a holds ranks 0 and 1, walk-b ranks 2 and 3
            walk_ins.append(
                Fdl(
                    "join",
                    f"127.0.0.1:{port}",
                    "--bin",
                    program,
                    "--host",
                    host,
                    "--devices",
                    "cpu:2",
                    env=env,
                )
            )
            deadline = time.monotonic() + 120
            while host not in _members(port) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert run.wait(240) == 1, run.output
        for walk in walk_ins:
            walk.wait(60)
    finally:
        for walk in walk_ins:
            walk.kill()
        run.kill()
    assert any(f"token {secret}" in walk.output for walk in walk_ins)  # rank 1 did print it
    return run.output, secret


@pytest.mark.parametrize("record", ["record", "no-record"])
def test_root_cause_names_the_rank_that_raised_first_across_two_hosts(record: str, tmp_path: Path) -> None:
    """With `@record` the error file dates the failure and names the exception; without, its traceback."""
    for index in range(REPEATS):
        output, secret = _one_run(tmp_path, index, [] if record == "record" else ["--no-record"])
        assert HEADER in output, output
        block = output[output.index(HEADER) :]
        # Exit code 1, or signal 15 when walk-a's teardown (after a victim's exit) caught rank 1 still
        # shutting down after it raised: either way rank 1 and its exception.
        culprit = r"rank 1 on host 'walk-a' \((exit code 1|signal 15)\): RuntimeError: rank 1 fails on"
        assert re.search(culprit, block), f"run {index}: {block}"
        assert re.search(r"\| (\[rank1\]: )?Traceback \(most recent call last\):", block), block
        assert "token <redacted>" in block and secret not in output, block
        summary = [line for line in output.splitlines() if "run FAILED" in line]
        assert summary and "root cause: rank 1 on host 'walk-a'" in summary[-1], output


def test_on_one_host_the_culprit_caught_mid_shutdown_by_the_teardown_is_still_the_root_cause() -> None:
    """`fdl run --ranks 3`: a victim (rank 0 or 2) usually exits before rank 1's interpreter has shut down,
    and the agent's SIGTERM then ends rank 1 (`signal 15`): rank 1 raised first, so it is still named.
    """
    for _ in range(3):
        run = Fdl(
            "run",
            "--ranks",
            "3",
            str(PROGRAMS / "root_cause.py"),
            env=child_env(ROOT_CAUSE_TEST_TOKEN="x" * 16),
        )
        assert run.wait(180) == 1, run.output
        block = run.output[run.output.index(HEADER) :]
        assert re.search(
            r"rank 1 on host '[^']+' \((exit code 1|signal 15)\): RuntimeError: rank 1 fails", block
        ), block
