"""Fan-out planning (pure) and whole fan-out runs through an in-process asyncssh server.

The "remote" host is this machine reached over SSH, so the agents, relays and ranks are real
processes and the run is a real gloo run; only the network distance is missing.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from flodld.agent.spec import AGENT_ENV, decode_agent_spec
from flodld.config.builder import ClusterBuilder
from flodld.config.models import ClusterConfig
from flodld.fanout.cluster_run import run_cluster_job
from flodld.fanout.launcher import (
    FanOutError,
    endpoint_for,
    interpreter_for,
    plan_agent,
    probe_device_count,
    wrap_command,
)
from tests.flodld.fanout.sshserver import LocalSshServer, start_local_ssh_server
from tests.hosts.netns import processes_mentioning

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = str(REPO / "examples" / "allreduce.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ssh(server: LocalSshServer) -> dict[str, object]:
    return {"target": "127.0.0.1", "port": server.port, "identity_file": str(server.client_key_path),
            "options": ["StrictHostKeyChecking=no"]}  # fmt: skip


def _cluster(server: LocalSshServer, *, tunnel: bool = False, ranks: int = 2) -> ClusterConfig:
    return (
        ClusterBuilder()
        .controller("127.0.0.1", _free_port())
        .join(join_timeout=60)
        .worker("remote-a", [f"cpu:{ranks}"], ssh=_ssh(server), path=str(REPO), tunnel=tunnel,
                env={"OMP_NUM_THREADS": "1"})
        .build()
    )  # fmt: skip


async def _wait_no_process(marker: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while processes_mentioning(marker) and time.monotonic() < end:
        await asyncio.sleep(0.1)
    assert processes_mentioning(marker) == [], f"orphans mentioning {marker}"


# --- the plan (pure) ---------------------------------------------------------------------------


def _worker(
    **settings: Any,  # noqa: ANN401  worker settings, passed on to ClusterBuilder.worker
) -> ClusterConfig:
    return (
        ClusterBuilder()
        .controller("10.0.0.1", 1337)
        .worker("node-a", ["cpu:2"], path="/srv/fl", **settings)
        .build()
    )


@pytest.mark.parametrize(
    ("settings", "python"),
    [
        ({}, "/srv/fl/.venv/bin/python"),
        ({"arch": "envs/cu128"}, "/srv/fl/envs/cu128/bin/python"),
        ({"arch": "/opt/py312"}, "/opt/py312/bin/python"),
        ({"docker": "cuda"}, "python"),
        ({"docker": "cuda", "arch": "/opt/venv"}, "/opt/venv/bin/python"),
    ],
)
def test_arch_selects_the_interpreter(settings: dict[str, Any], python: str) -> None:
    worker = _worker(**settings).workers[0]
    assert interpreter_for(worker, "/srv/fl") == python


def test_docker_wraps_the_command_and_passes_env_by_name_only() -> None:
    cluster = _worker(docker="cuda", env={"FOO": "bar"})
    plan = plan_agent(
        cluster.workers[0],
        cluster,
        program="train.py",
        args=["--lr", "1"],
        controller_port=1337,
        salt_hex="ab" * 16,
    )
    assert plan.argv == ("docker", "compose", "run", "--rm", "-T", "-e", "FOO", "-e", AGENT_ENV, "cuda",
                         "python", "-m", "flodld.agent")  # fmt: skip
    assert plan.spec.program == ["python", "train.py", "--lr", "1"]
    assert "ab" * 16 not in " ".join(plan.argv) and "bar" not in plan.argv
    assert wrap_command(cluster.workers[0].model_copy(update={"docker": None}), ["x"], ["A"]) == ["x"]


def test_plan_carries_salt_in_the_secret_env_and_tunnel_points_at_loopback() -> None:
    cluster = (ClusterBuilder().controller("10.0.0.1", 1337)
               .worker("node-b", ["cpu:1"], path="/p", tunnel=True,
                       ssh={"target": "b.lan", "port": 2222, "user": "u", "options": ["ProxyJump=bastion"]})
               .build())  # fmt: skip
    plan = plan_agent(
        cluster.workers[0], cluster, program="t.py", args=[], controller_port=1337, salt_hex="cd" * 16
    )
    assert (plan.endpoint.host, plan.endpoint.port, plan.endpoint.user) == ("b.lan", 2222, "u")
    assert plan.endpoint.parsed["ProxyJump"] == "bastion"
    spec = decode_agent_spec(plan.secret_env(40123)[AGENT_ENV])
    assert (spec.controller_host, spec.controller_port, spec.salt_hex) == ("127.0.0.1", 40123, "cd" * 16)
    assert spec.devices == ["cpu"] and spec.host == "node-b"
    with pytest.raises(FanOutError, match="node-b"):
        plan.secret_env(None)


def test_untunneled_plan_dials_the_advertised_controller() -> None:
    cluster = _worker()
    plan = plan_agent(
        cluster.workers[0], cluster, program="t.py", args=[], controller_port=1337, salt_hex=None
    )
    spec = decode_agent_spec(plan.secret_env(None)[AGENT_ENV])
    assert (spec.controller_host, spec.controller_port, spec.salt_hex) == ("10.0.0.1", 1337, None)
    assert endpoint_for(cluster.workers[0]).host == "node-a"


# --- whole runs over SSH ---------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tunnel", [False, True], ids=["direct", "tunneled"])
async def test_fan_out_run_completes_and_leaves_no_process(tmp_path: Path, tunnel: bool) -> None:
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / "allreduce_copy.py"  # a unique path to find leftovers by
    program.write_text(Path(EXAMPLE).read_text())
    said: list[str] = []
    lines: list[str] = []
    try:
        code = await run_cluster_job(
            str(program),
            ["--average"],
            _cluster(server, tunnel=tunnel),
            say=said.append,
            on_output=lambda host, line: lines.append(f"{host} {line}"),
        )
    finally:
        server.close()
    assert code == 0, "\n".join(said + lines)
    assert sum("all_reduce ok" in line for line in lines) == 2
    assert sum("relay average [0.5, 0.5, 0.5]" in line for line in lines) == 2
    if tunnel:
        assert any("bound to 127.0.0.1" in line for line in said)
        assert any(entry.startswith("remote-forward 127.0.0.1:") for entry in server.log)
    await _wait_no_process(str(program))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
async def test_agent_dying_before_formation_aborts_naming_its_host(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / "train.py"
    program.write_text("print('never started')\n")
    # The agent is `<interpreter> -m flodld.agent`; an interpreter that dies at once is an agent dying early.
    broken = tmp_path / "broken-env"
    (broken / "bin").mkdir(parents=True)
    (broken / "bin" / "python").write_text("#!/bin/sh\necho 'no flodld here'\nexit 3\n")
    (broken / "bin" / "python").chmod(0o755)
    cluster = _cluster(server)
    cluster = cluster.model_copy(
        update={"workers": [cluster.workers[0].model_copy(update={"arch": str(broken)})]}
    )
    said: list[str] = []
    try:
        code = await run_cluster_job(
            str(program), [], cluster, say=said.append, on_output=lambda host, line: None
        )
    finally:
        server.close()
    assert code == 1
    assert any("run FAILED" in line and "'remote-a'" in line and "code 3" in line for line in said), said


@pytest.mark.multiproc
@pytest.mark.timeout(180)
async def test_cancelled_launcher_stops_every_remote_process(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    program = tmp_path / "sleeper.py"
    program.write_text(
        "import sys, time\nimport flodld\n\n"
        "def main():\n    print('rank up', flush=True)\n    time.sleep(300)\n\n"
        "sys.exit(flodld.run(main, init_process_group=False))\n"
    )
    lines: list[str] = []
    job = asyncio.create_task(
        run_cluster_job(
            str(program),
            [],
            _cluster(server),
            say=lambda m: None,
            on_output=lambda h, line: lines.append(line),
            grace_s=2,
        )
    )
    try:
        end = time.monotonic() + 120
        while sum("rank up" in line for line in lines) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert sum("rank up" in line for line in lines) == 2, lines
        # The two ranks (the agent and relay are flodld's own processes: they never run the program).
        assert len(processes_mentioning(str(program))) >= 2
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
    finally:
        server.close()
    await _wait_no_process(str(program))


@pytest.mark.timeout(120)
async def test_unreachable_worker_fails_the_run_naming_it(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    cluster = _cluster(server)
    server.close()  # nothing listens on that port any more
    said: list[str] = []
    code = await run_cluster_job(EXAMPLE, [], cluster, say=said.append, on_output=lambda host, line: None)
    assert code == 1
    assert any("fan-out to host 'remote-a'" in line for line in said), said


@pytest.mark.timeout(120)
async def test_local_devices_all_is_probed_over_ssh_at_dispatch(tmp_path: Path) -> None:
    import torch

    server = await start_local_ssh_server(tmp_path)
    cluster = (ClusterBuilder().controller("127.0.0.1", _free_port())
               .worker("remote-a", "all", ssh=_ssh(server), path=str(REPO)).build())  # fmt: skip
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        if here:
            assert await probe_device_count(cluster.workers[0], str(REPO)) == here
        else:  # no CUDA device: the run stops before any window opens, naming the host
            said: list[str] = []
            code = await run_cluster_job(
                EXAMPLE, [], cluster, say=said.append, on_output=lambda host, line: None
            )
            assert code == 1
            assert any("'remote-a'" in line and "local_devices: all found no CUDA device" in line
                       for line in said), said  # fmt: skip
            assert not any("controller bound" in line for line in said)
    finally:
        server.close()


async def test_busy_controller_port_fails_before_any_agent_starts(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    cluster = _cluster(server)
    said: list[str] = []
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", cluster.controller.port))
        busy.listen()
        try:
            code = await run_cluster_job(
                EXAMPLE, [], cluster, say=said.append, on_output=lambda host, line: None
            )
        finally:
            server.close()
    assert code == 1
    assert any(f"cannot listen on 0.0.0.0:{cluster.controller.port}" in line for line in said), said
    assert "connect" not in server.log  # no SSH session was opened
