"""Restarts of a fan-out run (`fdl @cluster run --max-restarts N` with remote roster workers), over SSH.

The "remote" host is this machine behind an in-process asyncssh server (as in test_launcher.py), so the
agents, relays and ranks are real processes: a failed attempt is torn down over its SSH session and the
next one is launched afresh. tests/hosts/test_multi_host.py does the same across network namespaces with
real sshd.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from flodld.config.builder import ClusterBuilder
from flodld.fanout.cluster_run import run_cluster_job
from tests.flodld.fanout.sshserver import start_local_ssh_server
from tests.flodld.fanout.test_launcher import REPO, _cluster, _free_port, _ssh, _wait_no_process
from tests.hosts.netns import processes_mentioning

pytestmark = [pytest.mark.multiproc]

# argv[1]: fail-first (rank 1 exits 3 in attempt 1), fail-always (in every attempt), hang-first (attempt 1's
# ranks wait to be killed with their agent). Each rank prints its attempt, as torchrun's variable says.
PROGRAM = """\
import os, sys, time
import flodld


def main():
    mode, count, rank = sys.argv[1], int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    print(f"rank {rank} attempt {count} of max {os.environ['TORCHELASTIC_MAX_RESTARTS']} up", flush=True)
    if rank == 1 and (mode == "fail-always" or (mode == "fail-first" and count == 0)):
        return 3
    if mode == "hang-first" and count == 0:
        time.sleep(600)
    return 0


sys.exit(flodld.run(main, init_process_group=False))
"""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


async def _run(tmp_path: Path, mode: str, max_restarts: int) -> tuple[int, list[str], list[str]]:
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / f"restarts_{mode}.py"  # a unique path to find leftovers by
    program.write_text(PROGRAM)
    said: list[str] = []
    lines: list[str] = []
    try:
        run = run_cluster_job(
            str(program), [mode], _cluster(server), max_restarts=max_restarts, say=said.append,
            on_output=lambda host, line: lines.append(f"{host} {line}"), grace_s=2,
        )  # fmt: skip
        job = asyncio.ensure_future(run)
        if mode == "hang-first":  # kill attempt 1's agent (the ranks' parent) once both ranks are up
            end = time.monotonic() + 120
            while sum("attempt 0 of max" in line for line in lines) < 2 and time.monotonic() < end:
                await asyncio.sleep(0.1)
            ranks = processes_mentioning(str(program))
            agents = {_parent(pid) for pid in ranks}
            assert len(agents) == 1, (ranks, agents)
            os.kill(agents.pop(), signal.SIGKILL)
        code = await asyncio.wait_for(job, 150)
    finally:
        server.close()
    await _wait_no_process(str(program))
    return code, said, lines


@pytest.mark.timeout(240)
async def test_a_failed_attempt_is_relaunched_over_ssh_and_the_next_attempt_finishes(tmp_path: Path) -> None:
    code, said, lines = await _run(tmp_path, "fail-first", max_restarts=1)
    assert code == 0, "\n".join(said + lines)
    assert "restarting: attempt 2 of at most 2 (restart 1)" in said
    assert sum("attempt 1 of max 1 up" in line for line in lines) == 2  # both ranks, in a fresh world
    done = said[-1]
    assert done.startswith("run done: ") and "(after 1 restart(s): attempt 1: 1 of 2 ranks failed" in done
    bound = [line for line in said if line.startswith("controller bound to ")]
    assert len(bound) == 2 and bound[0].split(" (run ")[0] == bound[1].split(" (run ")[0]  # same port
    assert bound[0].split(" (run ")[1] != bound[1].split(" (run ")[1]  # a new run id


@pytest.mark.timeout(240)
async def test_exhausted_restarts_fail_the_run_naming_every_attempts_cause(tmp_path: Path) -> None:
    code, said, lines = await _run(tmp_path, "fail-always", max_restarts=1)
    assert code == 1, "\n".join(said + lines)
    summary = said[-1]
    assert summary.startswith("run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: "), said
    assert summary.count("1 of 2 ranks failed") == 2 and "attempt 2: " in summary, summary
    assert sum("Root cause (first observed failure):" in line for line in said) == 2  # as each verdict came


@pytest.mark.timeout(240)
async def test_a_killed_remote_agent_is_relaunched_and_its_ranks_do_not_outlive_it(tmp_path: Path) -> None:
    code, said, lines = await _run(tmp_path, "hang-first", max_restarts=1)
    assert code == 0, "\n".join(said + lines)
    assert "restarting: attempt 2 of at most 2 (restart 1)" in said
    assert sum("attempt 1 of max 1 up" in line for line in lines) == 2


# Each rank prints its attempt, world size and agent (parent) PID; attempt 1's wait to be torn down.
WAITING_PROGRAM = """\
import os, sys, time
import flodld


def main():
    count, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    world = os.environ["WORLD_SIZE"]
    print(f"rank {rank} attempt {count} world {world} agent {os.getppid()} up", flush=True)
    if count == 0:
        time.sleep(600)
    return 0


sys.exit(flodld.run(main, init_process_group=False))
"""


@pytest.mark.timeout(240)
async def test_a_roster_host_unreachable_at_a_restart_is_left_out_when_the_quorum_allows(
    tmp_path: Path,
) -> None:
    servers = [await start_local_ssh_server(tmp_path, name) for name in ("srv-a", "srv-b")]
    program = tmp_path / "left_out.py"
    program.write_text(WAITING_PROGRAM)
    builder = ClusterBuilder().controller("127.0.0.1", _free_port()).join(
        join_timeout=3, min_rank_start=1, target_ranks=2
    )
    for host, server in zip(("remote-a", "remote-b"), servers, strict=True):
        builder.worker(host, ["cpu"], ssh=_ssh(server), path=str(REPO), env={"OMP_NUM_THREADS": "1"})
    said: list[str] = []
    lines: list[str] = []
    try:
        job = asyncio.ensure_future(run_cluster_job(
            str(program), [], builder.build(), max_restarts=1, say=said.append,
            on_output=lambda host, line: lines.append(f"{host} {line}"), grace_s=2,
        ))  # fmt: skip
        end = time.monotonic() + 120
        while sum("attempt 0 world 2 agent" in line for line in lines) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        agent_b = next(
            int(line.split(" agent ")[1].split()[0]) for line in lines
            if line.startswith("remote-b ") and "attempt 0 world 2" in line
        )
        os.kill(agent_b, signal.SIGKILL)  # its agent dies: the attempt fails and remote-b must be relaunched,
        servers[1].close()  # but it cannot be reached any more: the restart must go on without it
        code = await asyncio.wait_for(job, 150)
    finally:
        for server in servers:
            server.close()
    assert code == 0, "\n".join(said + lines)
    assert any("host 'remote-b' left out of attempt 2" in line for line in said), said
    [second] = [line for line in lines if "attempt 1 world" in line]  # one rank, on remote-a, world of 1
    assert second.startswith("remote-a ") and " rank 0 attempt 1 world 1 agent " in second, lines
    await _wait_no_process(str(program))


# Each rank prints its attempt and its agent (parent) PID; attempt 1's ranks wait to be killed with theirs.
PARENT_PROGRAM = """\
import os, sys, time
import flodld


def main():
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"attempt {count} rank {os.environ['RANK']} agent {os.getppid()} up", flush=True)
    if count == 0:
        time.sleep(600)
    return 0


sys.exit(flodld.run(main, init_process_group=False))
"""


def _agents(lines: list[str], attempt: int) -> dict[str, int]:
    """Each host's agent PID in `attempt`, from its ranks' `attempt N rank R agent PID up` lines."""
    found = {}
    for line in list(lines):
        host, _, text = line.partition(" ")
        if f"attempt {attempt} rank " in text and text.endswith(" up"):
            found[host] = int(text.split(" agent ")[1].split()[0])
    return found


async def _kill_b_in_attempt_1(tmp_path: Path, program_text: str) -> tuple[int, list[str], list[str]]:
    """Run `program_text` on remote-a and remote-b (one CPU rank each, max_restarts 1) and SIGKILL
    remote-b's agent once both ranks of attempt 1 are up: remote-a's answers Reform and stays linked,
    remote-b is relaunched over SSH. Returns the exit code, what the launcher said and the hosts' lines.
    """
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / "two_hosts.py"
    program.write_text(program_text)
    builder = ClusterBuilder().controller("127.0.0.1", _free_port()).join(join_timeout=60)
    for host in ("remote-a", "remote-b"):
        builder.worker(host, ["cpu"], ssh=_ssh(server), path=str(REPO), env={"OMP_NUM_THREADS": "1"})
    said: list[str] = []
    lines: list[str] = []
    try:
        job = asyncio.ensure_future(run_cluster_job(
            str(program), [], builder.build(), max_restarts=1, say=said.append,
            on_output=lambda host, line: lines.append(f"{host} {line}"), grace_s=2,
        ))  # fmt: skip
        end = time.monotonic() + 120
        while len(_agents(lines, 0)) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        os.kill(_agents(lines, 0)["remote-b"], signal.SIGKILL)  # remote-b's agent dies mid-run
        code = await asyncio.wait_for(job, 150)
    finally:
        server.close()
    await _wait_no_process(str(program))
    return code, said, lines


@pytest.mark.timeout(240)
async def test_a_restart_keeps_the_linked_hosts_ssh_session_and_relaunches_only_the_lost_one(
    tmp_path: Path,
) -> None:
    code, said, lines = await _kill_b_in_attempt_1(tmp_path, PARENT_PROGRAM)
    assert code == 0, "\n".join(said + lines)
    first, second = _agents(lines, 0), _agents(lines, 1)
    assert second["remote-a"] == first["remote-a"], (first, second)  # the same agent: link and session kept
    assert second["remote-b"] != first["remote-b"], (first, second)  # relaunched over SSH
    assert any("staying linked for the next attempt" in line for line in lines if line.startswith("remote-a"))


# Attempt 1's ranks wait to be torn down (the test kills one host's agent); every later attempt's rank 0
# fails. The last attempt then has one host kept linked and one relaunched over SSH.
KEPT_THEN_FAILING_PROGRAM = PARENT_PROGRAM.replace(
    "    return 0\n", "    return 3 if os.environ['RANK'] == '0' else 0\n"
)


@pytest.mark.timeout(240)
async def test_exhausted_restarts_with_a_kept_and_a_relaunched_host_name_every_cause(
    tmp_path: Path,
) -> None:
    # CI once saw this shape (one host kept linked, one relaunched, the last attempt failing) wait five
    # minutes after its verdict without a word: every agent's end must reach the supervisor.
    code, said, lines = await _kill_b_in_attempt_1(tmp_path, KEPT_THEN_FAILING_PROGRAM)
    assert code == 1, "\n".join(said + lines)
    assert any("staying linked for the next attempt" in line for line in lines if line.startswith("remote-a"))
    summary = said[-1]
    assert summary.startswith("run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: "), said
    assert "attempt 2: 1 of 2 ranks failed (ranks [0])" in summary, summary
    assert not any("counted as lost" in line for line in said), said  # every end was reported, none guessed
