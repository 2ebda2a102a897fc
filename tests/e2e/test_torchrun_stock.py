"""A stock torchrun script (no flodld import; `init_process_group("gloo")` over env://) runs as is under
`fdl run SCRIPT` and `fdl join ... --bin SCRIPT` (issue 20, goal 3).

The agent and the relay are flodld's own processes, so the script's top level runs in ranks only; env://
reaches the controller's authenticated store through each agent's loopback TCPStore endpoint.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest

from tests.e2e.harness import PROGRAMS, Fdl, child_env, free_port, write_discovery_project

pytestmark = pytest.mark.multiproc

STOCK = str(PROGRAMS / "torchrun_stock.py")


def _check_world(output: str, world: int, locals_: dict[int, tuple[int, int]], hosts: int = 1) -> None:
    lines = re.findall(r"stock rank=(\d+)/(\d+) local=(\d+)/(\d+) sum=(\d+) pair=(\d+) group=(\S+)", output)
    assert sorted(int(rank) for rank, *_ in lines) == list(range(world)), output[-6000:]
    total = world * (world + 1) // 2
    per_host = world // hosts
    for rank, size, local, local_size, got_sum, pair, group in lines:
        # torchrun's node rank: hosts ordered by their ranks (each walk-in holds a contiguous range).
        assert group == f"{int(rank) // per_host}/{hosts}", output[-6000:]
        assert (int(size), int(got_sum)) == (world, total), output[-6000:]
        assert (int(local), int(local_size)) == locals_[int(rank)], output[-6000:]
        assert int(pair) == (3 if int(rank) in (0, 1) else int(rank) + 1), output[-6000:]
    # The script's top level ran once per rank, each time as a rank pointed at its agent's loopback store.
    tops = [(line[0], tuple(line[1:])) for line in re.findall(
        r"stock top-level RANK=(\S+) MASTER_ADDR=(\S+) salt_in_env=(\S+) argv0=(\S+) name=(\S+)", output)]
    assert sorted(int(rank) for rank, _ in tops) == list(range(world)), output[-6000:]
    # As `python torchrun_stock.py` would run it, and with the session salt already out of its environment
    # (flodld.launcher.rank claimed it), so the script's own subprocesses never inherit it.
    assert {rest for _, rest in tops} == {("127.0.0.1", "False", "torchrun_stock.py", "__main__")}, output[
        -6000:
    ]


def test_the_same_script_under_torchrun_prints_the_same_world() -> None:
    # The baseline: what the script prints under torchrun itself (its top level with torchrun's variables).
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", STOCK], env=child_env(),
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = sorted(
        re.findall(r"stock rank=\d/2 local=\d/2 sum=3 pair=3 group=\d+/\d+", done.stdout)
    )  # two processes share the pipe: a line may lose its newline
    assert lines == ["stock rank=0/2 local=0/2 sum=3 pair=3 group=0/1",
                     "stock rank=1/2 local=1/2 sum=3 pair=3 group=0/1"], done.stdout  # fmt: skip


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_stock_torchrun_script_runs_as_is_under_fdl_run(ranks: int) -> None:
    run = Fdl("run", "--ranks", str(ranks), STOCK)
    assert run.wait(240) == 0, run.output[-6000:]
    _check_world(run.output, ranks, {rank: (rank, ranks) for rank in range(ranks)})
    assert "fdl run: run done" in run.output


def test_a_stock_script_outlives_the_startup_grace_its_heartbeats_come_from_flodlds_rank_launcher() -> None:
    # The script never imports flodld; its heartbeats come from flodld.launcher.rank, which opened its relay
    # legs before running it. Without them the controller declares a silent rank dead after the grace.
    # The grace (from the world's forming) covers starting the relay and the launchers, which import no
    # torch: 7 s. The step is as long as the grace and comes after the script's torch import and gloo
    # rendezvous, so the script outlives the grace whatever the machine's load.
    env = child_env(FLODL_LIVENESS_STARTUP_SECS="7", FLODL_LIVENESS_TIMEOUT_SECS="3")
    run = Fdl("run", "--ranks", "2", STOCK, "--", "7", env=env)
    assert run.wait(240) == 0, run.output[-6000:]
    _check_world(run.output, 2, {0: (0, 2), 1: (1, 2)})
    assert "sent no heartbeat" not in run.output


def test_a_stock_torchrun_script_runs_as_is_under_fdl_join_bin(tmp_path: Path) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(tmp_path, port, token, ranks=4)
    run = Fdl("run", "--project", str(project), STOCK)
    try:
        run.wait_for(r"waiting — window open")
        env = child_env(FDL_JOIN_TOKEN=token)
        walk_a = Fdl(
            "join", f"127.0.0.1:{port}", "--bin", STOCK, "--host", "walk-a", "--devices", "cpu:2", env=env
        )
        walk_b = Fdl(
            "join", f"127.0.0.1:{port}", "--bin", STOCK, "--host", "walk-b", "--devices", "cpu:2", env=env
        )
        assert walk_a.wait(240) == 0, walk_a.output[-6000:]
        assert walk_b.wait(240) == 0, walk_b.output[-6000:]
        assert run.wait(60) == 0, run.output[-6000:]
    finally:
        run.kill()
    # Each walk-in holds two ranks; which pair a host got depends on the join order.
    _check_world(
        walk_a.output + "\n" + walk_b.output, 4, {0: (0, 2), 1: (1, 2), 2: (0, 2), 3: (1, 2)}, hosts=2
    )
