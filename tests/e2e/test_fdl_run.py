"""`fdl run` on the embedded default: real controller, agent, relay and gloo ranks on loopback."""

from __future__ import annotations

import json
import re
import secrets
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.harness import (
    EXAMPLES,
    PROGRAMS,
    Fdl,
    child_env,
    free_port,
    pid_alive,
    write_discovery_project,
)

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("ranks", [2, 3])
def test_fdl_run_completes_a_gloo_all_reduce_and_a_relay_average(ranks: int) -> None:
    run = Fdl("run", "--ranks", str(ranks), str(EXAMPLES / "allreduce.py"), "--", "--average")
    assert run.wait() == 0, run.output
    expected = float(ranks * (ranks + 1) // 2)
    assert len(re.findall(rf"all_reduce ok \[{expected}, ", run.output)) == ranks, run.output
    assert len(re.findall(r"relay average", run.output)) == ranks
    assert "fdl run: run done" in run.output


def ready_pids(run: Fdl, ranks: int) -> dict[int, tuple[int, int]]:
    matches = run.wait_for(r"ready rank=(\d+) pid=(\d+) ppid=(\d+)", count=ranks)
    return {int(m[1]): (int(m[2]), int(m[3])) for m in matches}


def test_a_rank_exiting_3_fails_the_run_naming_it_and_tears_the_others_down() -> None:
    run = Fdl("run", str(PROGRAMS / "sleeper.py"), "--", "--fail-rank", "1", "--code", "3")
    pids = ready_pids(run, 2)
    assert run.wait() == 1, run.output
    assert "rank 1 exited with code 3" in run.output
    assert re.search(r"run FAILED: .*\[1\]", run.output), run.output
    # Rank 0 was blocked forever; only the teardown ended it: the supervisor's TERM (KILL after the 5 s
    # grace), or its relay going away first, which a rank answers by exiting instead of hanging.
    assert re.search(r"rank 0 exited with (signal (15|9)|code 1)", run.output), run.output
    assert "tearing down host '127.0.0.1' (rank 1 exited with code 3)" in run.output
    assert not any(pid_alive(pid) for pid, _ in pids.values())


def test_abort_from_the_controller_stops_every_child() -> None:
    run = Fdl("run", str(PROGRAMS / "sleeper.py"))
    pids = ready_pids(run, 2)
    agent_pid = pids[0][1]
    run.signal(signal.SIGINT)  # fdl run aborts the run: Abort goes down the join link
    assert run.wait() == 1, run.output
    assert "abort from the controller" in run.output
    assert "run FAILED" in run.output
    assert not pid_alive(agent_pid)
    assert not any(pid_alive(pid) for pid, _ in pids.values())


def test_killing_the_agent_ends_its_host_link_and_the_controller_reports_it() -> None:
    run = Fdl("run", str(PROGRAMS / "sleeper.py"))
    pids = ready_pids(run, 2)
    agent_pid = pids[0][1]
    import os

    os.kill(agent_pid, signal.SIGKILL)
    assert run.wait() == 1, run.output
    assert re.search(r"run FAILED: .*host '127\.0\.0\.1'", run.output), run.output
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid, _ in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(pid) for pid, _ in pids.values()), "ranks outlived their killed agent"


@pytest.mark.parametrize("lower", [False, True])
def test_fdl_run_executes_the_ir_example_program_on_three_ranks_checked_by_decryption(lower: bool) -> None:
    args = ["--lower"] if lower else []
    run = Fdl("run", "--ranks", "3", str(EXAMPLES / "ir_allreduce.py"), "--", *args)
    assert run.wait() == 0, run.output
    form = "generic all_reduce" if lower else "all_reduce_add_ciphertext"
    verdicts = re.findall(
        rf"rank (\d)/3: {form} decrypts to world\*chunk\*x \(max error (\S+)\): True", run.output
    )
    assert sorted(rank for rank, _ in verdicts) == ["0", "1", "2"], run.output
    assert all(float(error) < 1e-4 for _, error in verdicts)
    assert "fdl run: run done" in run.output


def _argv_lines(run: Fdl) -> dict[str, list[str]]:
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"argv rank=(\d+) (\[.*\])", run.output)}


def test_a_torchrun_command_line_gives_every_word_after_the_program_to_the_program() -> None:
    # torchrun --nproc-per-node 2 train.py 1 5 --batch_size 4 --port 29999, renamed (issue 30, goal 3): the
    # program's --port is not the controller's, and fdl's world is --nproc-per-node's 2 ranks.
    words = ["1", "5", "--batch_size", "4", "--port", "29999"]
    run = Fdl("run", "--nproc-per-node", "2", str(PROGRAMS / "argv_echo.py"), *words)
    assert run.wait() == 0, run.output
    assert _argv_lines(run) == {"0": words, "1": words}, run.output
    assert "2 CPU rank(s), backend gloo (from --nproc-per-node 2)" in run.output
    port = re.search(r"controller on 127\.0\.0\.1:(\d+)", run.output)
    assert port is not None and port[1] != "29999", run.output


def test_local_ranks_filter_shows_only_those_ranks_lines() -> None:
    program = str(PROGRAMS / "argv_echo.py")
    run = Fdl("run", "--nproc-per-node", "3", "--local-ranks-filter", "0,2", program, "x")
    assert run.wait() == 0, run.output
    assert _argv_lines(run) == {"0": ["x"], "2": ["x"]}, run.output
    assert "fdl run: run done" in run.output  # fdl's own lines are not filtered


def test_a_module_runs_with_dash_m_and_gets_its_arguments() -> None:
    run = Fdl("run", "--nproc-per-node", "2", "-m", "tests.e2e.programs.argv_echo", "--ranks", "1", "x")
    assert run.wait() == 0, run.output
    assert _argv_lines(run) == {"0": ["--ranks", "1", "x"], "1": ["--ranks", "1", "x"]}, run.output


def test_the_readmes_single_key_command_works() -> None:
    # README: `fdl run examples/encrypted_mean.py --keys single` (the program's flag, no `--`).
    run = Fdl("run", str(EXAMPLES / "encrypted_mean.py"), "--keys", "single")
    assert run.wait(600) == 0, run.output[-6000:]
    assert "public key from rank 0" in run.output, run.output[-6000:]
    assert "rank 0/2: encrypted mean PASS" in run.output and "keys single" in run.output
    assert "fdl run: run done" in run.output


def test_an_rdzv_endpoint_walks_in_to_a_running_controller(tmp_path: Path) -> None:
    # torchrun --nnodes 2 --rdzv-endpoint HOST:PORT on a second box, renamed: it joins as `fdl join` would.
    port, token = free_port(), secrets.token_hex(16)
    host = write_discovery_project(tmp_path, port, token, ranks=4)  # a controller with no worker of its own
    program = str(PROGRAMS / "argv_echo.py")
    # --nnodes 1:2 x --nproc-per-node 1: quorum 1, target 2 ranks (over fdl.yml's 4): the walk-in's 2 form it.
    controller = Fdl("run", "--project", str(host), "--nnodes", "1:2", "--nproc-per-node", "1", program)
    controller.wait_for(r"waiting — window open")
    walk_dir = tmp_path / "walk"
    walk_dir.mkdir()
    walk_in = Fdl(
        "run", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "2",
        program, "1", "--port", "29999",
        cwd=walk_dir, env=child_env(FDL_JOIN_TOKEN=token),
    )  # fmt: skip
    try:
        assert walk_in.wait() == 0, walk_in.output
        assert controller.wait() == 0, controller.output
    finally:
        walk_in.kill()
        controller.kill()
    assert f"walking in to the controller at 127.0.0.1:{port}" in walk_in.output
    assert _argv_lines(walk_in) == {"0": ["1", "--port", "29999"], "1": ["1", "--port", "29999"]}
    assert "fdl run: run done" in controller.output
    assert "--nnodes: quorum 1, target 2 rank(s)" in controller.output
