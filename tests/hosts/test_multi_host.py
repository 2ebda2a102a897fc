"""Across "real hosts": network namespaces, each worker running its own OpenSSH sshd.

The controller box and two workers are separate network stacks joined by veth pairs; the
launcher fans out over SSH exactly as it would to other machines. PIDs are shared (one
kernel), which lets the tests prove that no process of the run outlives it on any host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodld.fanout.sshd_recipe import JoinSshdRecipe
from tests.conftest import require_binary
from tests.flodld.fanout.joinuser import as_join_user, door_directory, hand_to_join_user, join_user
from tests.hosts.netns import (
    SSHD_PORT,
    Lab,
    controller_address,
    kill_leftovers,
    processes_mentioning,
    require_netns,
    worker_address,
)

pytestmark = [pytest.mark.netns, pytest.mark.sshd, pytest.mark.multiproc]
REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")
CONTROLLER_PORT = 29517
RELAY_ONLY_PROGRAM = """
import sys
import torch
import flodld
from flodld.rank.averaging import all_average
from flodld.rank.env import read_rank_environment


def main():
    env = read_rank_environment()
    (mean,) = all_average([torch.full((3,), float(env.rank))])
    print(f"rank {env.rank}/{env.world_size} via {env.controller_host}:{env.controller_port} "
          f"mean {mean.tolist()}", flush=True)
    return 0 if torch.allclose(mean, torch.full((3,), (env.world_size - 1) / 2)) else 1


sys.exit(flodld.run(main, init_process_group=False))
"""
SLEEPER_PROGRAM = """
import sys, time
import flodld


def main():
    print("rank up", flush=True)
    time.sleep(600)


sys.exit(flodld.run(main, init_process_group=False))
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    require_netns()
    sshd = require_binary("sshd", "sshd", search_sbin=True)
    keygen = require_binary("sshd", "ssh-keygen")
    lab = Lab(root=tmp_path, workers=2)
    try:
        lab.build()
        for index in (1, 2):
            lab.start_worker_sshd(index, sshd, keygen)
        yield lab
    finally:
        lab.close()
        kill_leftovers(str(tmp_path))


def _cluster(lab: Lab, *, tunnel: bool, max_restarts: int = 0) -> dict[str, object]:
    def worker(index: int) -> dict[str, object]:
        return {
            "host": f"node-{index}",
            "local_devices": ["cpu:2"],
            "path": str(REPO),
            "tunnel": tunnel,
            "ssh": {
                "target": worker_address(index),
                "port": SSHD_PORT,
                "user": "root",
                "identity_file": str(lab.client_key),
                "options": ["StrictHostKeyChecking=no", "ServerAliveInterval=1", "ServerAliveCountMax=3"],
            },
            "env": {"GLOO_SOCKET_IFNAME": "fdl0", "OMP_NUM_THREADS": "1"},
        }

    return {
        "controller": {
            "host": controller_address(1),
            "port": CONTROLLER_PORT,
            "join": {"join_timeout": 120, "max_restarts": max_restarts},
        },
        "workers": [worker(1), worker(2)],
    }


def _fanout(lab: Lab, cluster: dict[str, object], program: Path, *args: str) -> subprocess.Popen[bytes]:
    config = lab.root / "cluster.json"
    config.write_text(json.dumps(cluster))
    return lab.spawn(
        lab.controller_ns,
        [PYTHON, "-m", "tests.hosts.drivers", "fanout", str(config), str(program), *args],
        log=lab.root / "launcher.log",
        cwd=REPO,
    )


def _wait(process: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGUSR1)  # the fan-out driver dumps its stacks (drivers.py); others end
        time.sleep(2.0)
        text = log.read_text(errors="replace")
        raise AssertionError(f"timed out; log so far:\n{text[-12000:]}") from None
    return log.read_text(errors="replace")


def _assert_no_process_left(marker: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while processes_mentioning(marker) and time.monotonic() < end:
        time.sleep(0.2)
    assert processes_mentioning(marker) == [], f"processes left behind mentioning {marker}"


@pytest.mark.timeout(300)
def test_fan_out_two_hosts_two_cpu_ranks_completes_a_run(lab: Lab) -> None:
    program = lab.root / "allreduce_multi.py"
    program.write_text((REPO / "examples" / "allreduce.py").read_text())
    launcher = _fanout(lab, _cluster(lab, tunnel=False), program, "--average")
    log = _wait(launcher, lab.root / "launcher.log", 240)
    assert launcher.returncode == 0, log[-6000:]
    assert log.count("all_reduce ok [10.0, 20.0, 30.0, 40.0]") == 4, log[-6000:]
    assert log.count("relay average [1.5, 1.5, 1.5]") == 4
    assert "[node-1]" in log and "[node-2]" in log
    _assert_no_process_left(str(program))


@pytest.mark.timeout(300)
def test_tunneled_workers_complete_a_cpu_sync_run_with_a_loopback_controller(lab: Lab) -> None:
    program = lab.root / "relay_only.py"
    program.write_text(RELAY_ONLY_PROGRAM)
    launcher = _fanout(lab, _cluster(lab, tunnel=True), program)
    log = _wait(launcher, lab.root / "launcher.log", 240)
    assert launcher.returncode == 0, log[-6000:]
    assert f"controller bound to 127.0.0.1:{CONTROLLER_PORT}" in log
    assert "2 fan-out agent(s) (2 tunneled)" in log
    lines = [line for line in log.splitlines() if " mean [1.5, 1.5, 1.5]" in line]
    assert len(lines) == 4, log[-6000:]
    assert all("via 127.0.0.1:" in line for line in lines)  # every rank rode its host's tunnel
    _assert_no_process_left(str(program))


def _sleepers_started(lab: Lab, name: str) -> tuple[Path, subprocess.Popen[bytes], Path]:
    """A fan-out of SLEEPER_PROGRAM (as NAME) over both workers, once its 4 ranks are up (or 180 s passed).

    Returns (the program, the launcher, its log).
    """
    program = lab.root / name
    program.write_text(SLEEPER_PROGRAM)
    launcher = _fanout(lab, _cluster(lab, tunnel=False), program)
    log_path = lab.root / "launcher.log"
    end = time.monotonic() + 180
    while log_path.read_text(errors="replace").count("rank up") < 4 and time.monotonic() < end:
        assert launcher.poll() is None, log_path.read_text(errors="replace")[-4000:]
        time.sleep(0.2)
    return program, launcher, log_path


@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_leaves_no_process_on_any_host(lab: Lab) -> None:
    program, launcher, log_path = _sleepers_started(lab, "sleeper.py")
    assert log_path.read_text(errors="replace").count("rank up") == 4
    assert len(processes_mentioning(str(program))) >= 4  # the ranks run the program
    assert len(lab.worker_processes()) >= 8  # per host: agent, relay, two ranks
    os.killpg(launcher.pid, signal.SIGTERM)  # `ip netns exec` execs, so this reaches the launcher
    log = _wait(launcher, log_path, 60)
    assert launcher.returncode == 1, log[-4000:]
    assert "interrupted" in log
    _assert_no_process_left(str(program))
    end = time.monotonic() + 20
    while lab.worker_processes() and time.monotonic() < end:
        time.sleep(0.2)
    assert lab.worker_processes() == [], "agents, relays or ranks left behind on a worker host"


@pytest.mark.timeout(300)
def test_walk_in_over_join_ssh_joins_a_discovery_window(lab: Lab) -> None:
    sshd = require_binary("sshd", "sshd", search_sbin=True)
    keygen = require_binary("sshd", "ssh-keygen")
    # The controller box: a tunnel_only discovery controller on loopback and a guardrailed join sshd.
    door = door_directory()  # the door's sshd runs as the join user, never root (issue 13 point 13)
    user = join_user()
    walker_key = lab.root / "walker_key"
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(walker_key)], check=True)
    recipe = JoinSshdRecipe(controller_port=CONTROLLER_PORT, listen_port=2222,
                            public_keys=(Path(f"{walker_key}.pub").read_text(),), join_user=user)  # fmt: skip
    recipe.write(door)
    subprocess.run(recipe.host_key_command(door), check=True)
    hand_to_join_user(door, user)
    lab.spawn(lab.controller_ns, as_join_user([sshd, "-D", "-e", "-f", str(door / "sshd_config")], user),
              log=lab.root / "sshd.log")  # fmt: skip
    lab.wait_listening(lab.controller_ns, controller_address(1), 2222)
    options = {"port": CONTROLLER_PORT, "averaging": "cpu_sync",
               "join": {"discovery": True, "tunnel_only": True, "min_rank_start": 2, "target_ranks": 2,
                        "join_timeout": 120}}  # fmt: skip
    (lab.root / "options.json").write_text(json.dumps(options))
    serve_log = lab.root / "serve.log"
    controller = lab.spawn(
        lab.controller_ns,
        [PYTHON, "-m", "tests.hosts.drivers", "serve", str(lab.root / "options.json")],
        log=serve_log,
        cwd=REPO,
    )
    end = time.monotonic() + 60
    while "listening" not in serve_log.read_text() and time.monotonic() < end:
        assert controller.poll() is None, serve_log.read_text()
        time.sleep(0.2)
    assert f"listening 127.0.0.1:{CONTROLLER_PORT}" in serve_log.read_text()
    # A worker outside walks in through the door with `fdl join --ssh`: only the forward reaches the
    # controller.
    program = lab.root / "walker_allreduce.py"
    program.write_text((REPO / "examples" / "allreduce.py").read_text())
    project = lab.root / "walker_project"
    project.mkdir()
    (project / "fdl.yml").write_text(
        "join:\n  ssh:\n    target: unused\n"
        "    options: [StrictHostKeyChecking=no, UserKnownHostsFile=/dev/null]\n"
    )
    walk_log = lab.root / "walker.log"
    walker = lab.spawn(
        lab.worker_ns(1),
        [
            str(REPO / ".venv" / "bin" / "fdl"),
            "join",
            "--project",
            str(project),
            "--ssh",
            f"{user}@{controller_address(1)}:2222",
            "--identity",
            str(walker_key),
            "--bin",
            str(program),
            "--host",
            "walker",
            "--devices",
            "cpu:2",
            f"127.0.0.1:{CONTROLLER_PORT}",
            "--",
            "--average",
        ],
        log=walk_log,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    walked = _wait(walker, walk_log, 240)
    assert walker.returncode == 0, walked[-6000:]
    assert f"-> 127.0.0.1:{CONTROLLER_PORT} via {user}@{controller_address(1)}:2222" in walked
    assert walked.count("relay average [0.5, 0.5, 0.5]") == 2
    served = _wait(controller, serve_log, 60)
    assert controller.returncode == 0 and "result done" in served, served
    _assert_no_process_left(str(program))


@pytest.mark.timeout(300)
def test_a_dead_network_is_noticed_by_keepalives_and_every_process_ends(lab: Lab) -> None:
    program, launcher, log_path = _sleepers_started(lab, "sleeper_cut.py")
    subprocess.run(["ip", "-n", lab.worker_ns(1), "link", "set", "fdl0", "down"], check=True)  # cable pulled
    log = _wait(launcher, log_path, 90)
    assert launcher.returncode == 1, log[-4000:]
    assert "SSH session to host 'node-1' lost" in log, log[-4000:]
    # node-1's sshd stops hearing the launcher too and hangs up the session: its supervisor tears down.
    _assert_no_process_left(str(program), timeout=60)


@pytest.mark.timeout(400)
def test_encrypted_mean_over_tunnels_with_a_loopback_controller(lab: Lab) -> None:
    from tests.flagship.workload import ENCRYPTED_MEAN, assert_encrypted_mean_passed, encrypted_mean_args

    launcher = _fanout(lab, _cluster(lab, tunnel=True), ENCRYPTED_MEAN, *encrypted_mean_args())
    log = _wait(launcher, lab.root / "launcher.log", 360)
    assert launcher.returncode == 0, log[-6000:]
    assert f"controller bound to 127.0.0.1:{CONTROLLER_PORT}" in log
    assert "2 fan-out agent(s) (2 tunneled)" in log
    errors = assert_encrypted_mean_passed(log, world_size=4)
    assert max(errors) < 1e-6
    _assert_no_process_left(str(ENCRYPTED_MEAN))


def _pids_in(lab: Lab, index: int) -> set[int]:
    listed = subprocess.run(["ip", "netns", "pids", lab.worker_ns(index)], capture_output=True, text=True)
    return {int(pid) for pid in listed.stdout.split()}


def _rank_lines(log: str, text: str) -> int:
    """How many of the ranks' own lines (`[node-N] ...`, not the root-cause block quoting one) hold `text`."""
    return sum(text in line for line in log.splitlines() if line.startswith("[node-"))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.mark.timeout(400)
def test_a_killed_agent_is_relaunched_over_ssh_and_the_restarted_world_finishes(lab: Lab) -> None:
    """node-1's agent SIGKILLed mid-run: it is relaunched over SSH; node-2's agent stays linked (Reform)."""
    from tests.flodld.fanout.test_fanout_restarts import PROGRAM

    program = lab.root / "restart_hang.py"
    program.write_text(PROGRAM)
    launcher = _fanout(lab, _cluster(lab, tunnel=False, max_restarts=1), program, "hang-first")
    log_path = lab.root / "launcher.log"
    end = time.monotonic() + 180
    while log_path.read_text(errors="replace").count("attempt 0 of max 1 up") < 4 and time.monotonic() < end:
        assert launcher.poll() is None, log_path.read_text(errors="replace")[-4000:]
        time.sleep(0.2)
    ranks_1 = set(processes_mentioning(str(program))) & _pids_in(lab, 1)
    agents = {_parent(pid) for pid in ranks_1}
    assert len(ranks_1) == 2 and len(agents) == 1, (ranks_1, agents)
    os.kill(agents.pop(), signal.SIGKILL)  # node-1's agent dies mid-run; node-2's is fine
    log = _wait(launcher, log_path, 240)
    assert launcher.returncode == 0, log[-6000:]
    assert "restarting: attempt 2 of at most 2 (restart 1)" in log
    assert _rank_lines(log, "attempt 1 of max 1 up") == 4, log[-6000:]  # both hosts in the re-formed world
    assert "run done: every host link closed (after 1 restart(s): attempt 1: " in log
    # node-2 stayed linked (its agent answered Reform and served attempt 2); only node-1 was relaunched
    dialed = {node: _rank_lines(log, f"host '{node}' dialing controller") for node in ("node-1", "node-2")}
    assert dialed == {"node-1": 2, "node-2": 1}, log[-6000:]
    assert _rank_lines(log, "staying linked for the next attempt") == 1, log[-6000:]
    assert not ranks_1 & set(processes_mentioning(str(program)))  # the killed agent's ranks went with it
    _assert_no_process_left(str(program))
    end = time.monotonic() + 20
    while lab.worker_processes() and time.monotonic() < end:
        time.sleep(0.2)
    assert lab.worker_processes() == [], "agents, relays or ranks left behind on a worker host"


@pytest.mark.timeout(400)
def test_exhausted_restarts_over_ssh_fail_naming_every_cause_and_leave_no_process(lab: Lab) -> None:
    from tests.flodld.fanout.test_fanout_restarts import PROGRAM

    program = lab.root / "restart_fail.py"
    program.write_text(PROGRAM)
    launcher = _fanout(lab, _cluster(lab, tunnel=True, max_restarts=1), program, "fail-always")
    log = _wait(launcher, lab.root / "launcher.log", 300)
    assert launcher.returncode == 1, log[-6000:]
    summary = next(line for line in log.splitlines() if "run FAILED" in line)
    assert "run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: " in summary, summary
    assert summary.count("ranks failed") == 2 and "attempt 2: " in summary, summary
    assert _rank_lines(log, "attempt 1 of max 1 up") == 4  # the second attempt ran on both hosts, tunneled
    _assert_no_process_left(str(program))
    end = time.monotonic() + 20
    while lab.worker_processes() and time.monotonic() < end:
        time.sleep(0.2)
    assert lab.worker_processes() == [], "agents, relays or ranks left behind on a worker host"
