"""`fdl join --ssh` plumbing against a real OpenSSH sshd (the guardrailed join recipe) on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodld.agent.spec import AgentSpec
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.fanout.forward import ForwardError, open_forward, parse_ssh_target, run_agent_through_forward
from flodld.fanout.ssh import SshEndpoint
from tests.conftest import require_binary
from tests.flodld.fanout.joinuser import join_user
from tests.hosts.conftest import JoinSshd, free_port, start_join_sshd

pytestmark = pytest.mark.sshd
REPO = Path(__file__).resolve().parents[2]
NO_KNOWN_HOSTS = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null")


def _endpoint(sshd: JoinSshd, key: Path | None = None) -> SshEndpoint:
    return parse_ssh_target(f"{join_user()}@127.0.0.1:{sshd.listen}", str(key or sshd.key), NO_KNOWN_HOSTS)


@pytest.fixture
def sshd_for_port(tmp_path: Path) -> Iterator[tuple[JoinSshd, int]]:
    controller_port = free_port()
    sshd, proc = start_join_sshd(tmp_path, controller_port)
    try:
        yield sshd, controller_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_forward_carries_bytes_to_the_permitted_port(join_sshd: tuple[int, Path, int, int]) -> None:
    listen, key, allowed, _ = join_sshd
    endpoint = parse_ssh_target(f"{join_user()}@127.0.0.1:{listen}", str(key), NO_KNOWN_HOSTS)
    first = open_forward(endpoint, ("127.0.0.1", allowed))
    second = open_forward(endpoint, ("127.0.0.1", allowed))
    try:
        assert first.local_port != second.local_port  # fresh per attempt
        with socket.create_connection(("127.0.0.1", first.local_port), timeout=10) as sock:
            sock.sendall(b"ping")
            assert sock.recv(100) == b"echo:ping"
    finally:
        first.close()
        second.close()
    assert not first.alive and not second.alive


def test_unaccepted_key_fails_fast_without_prompting(join_sshd: tuple[int, Path, int, int],
                                                          tmp_path: Path) -> None:  # fmt: skip
    listen, _, allowed, _ = join_sshd
    stranger = tmp_path / "stranger"
    subprocess.run(
        [require_binary("sshd", "ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
        check=True,
    )
    endpoint = parse_ssh_target(f"x@127.0.0.1:{listen}", str(stranger), NO_KNOWN_HOSTS)
    started = time.monotonic()
    with pytest.raises(ForwardError, match="Permission denied"):
        open_forward(endpoint, ("127.0.0.1", allowed), timeout=20)
    assert time.monotonic() - started < 20


@pytest.mark.multiproc
@pytest.mark.timeout(180)
async def test_walk_in_joins_a_tunnel_only_window_through_the_join_sshd(
    sshd_for_port: tuple[JoinSshd, int],
) -> None:
    sshd, port = sshd_for_port
    options = ControllerOptions.model_validate(
        {
            "port": port,
            "averaging": "cpu_sync",
            "join": {
                "discovery": True,
                "tunnel_only": True,
                "min_rank_start": 2,
                "target_ranks": 2,
                "join_timeout": 60,
            },
        }
    )
    controller = Controller(options)
    attach_data_plane(controller)
    bind, _ = await controller.start()
    assert bind == "127.0.0.1"  # tunnel_only: reachable through sshd only
    spec = AgentSpec(host="walker", controller_host="unused", controller_port=1, devices=["cpu:2"],
                     averaging="cpu_sync")  # fmt: skip
    command = [sys.executable, str(REPO / "examples" / "allreduce.py"), "--average"]
    try:
        code = await run_agent_through_forward(
            _endpoint(sshd),
            ("127.0.0.1", port),
            spec,
            command,
            environ={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        )
        result = await controller.wait()
    finally:
        await controller.close()
    assert code == 0
    assert result.ok, result.reason
