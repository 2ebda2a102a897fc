"""`fdl @cluster run` and `fdl @cluster probe` as commands, fanning out over SSH.

The SSH server is in this test's process (asyncssh, loopback); the `fdl` command is a real
subprocess, so the overlay selection, the CLI wiring and the fan-out are exercised together.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from tests.flodld.fanout.sshserver import LocalSshServer, start_local_ssh_server

REPO = Path(__file__).resolve().parents[3]
FDL = str(REPO / ".venv" / "bin" / "fdl")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _project(tmp_path: Path, server: LocalSshServer) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "fdl.yml").write_text("join:\n  address: 127.0.0.1\n")
    (project / "fdl.cluster.yml").write_text(
        "cluster:\n"
        f"  controller: {{host: 127.0.0.1, port: {_free_port()}}}\n"
        "  workers:\n"
        "    - host: far-away\n"
        "      local_devices: [cpu:2]\n"
        f"      path: {REPO}\n"
        "      env: {OMP_NUM_THREADS: '1'}\n"
        f"      ssh: {{target: 127.0.0.1, port: {server.port}, identity_file: {server.client_key_path},\n"
        "            options: [StrictHostKeyChecking=no]}\n"
    )
    return project


async def _fdl(project: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FDL, "@cluster", *args, cwd=project, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 150)
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
async def test_cluster_run_fans_out_and_completes(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    try:
        code, out, err = await _fdl(
            _project(tmp_path, server), "run", str(REPO / "examples" / "allreduce.py")
        )
    finally:
        server.close()
    assert code == 0, err[-4000:]
    assert out.count("all_reduce ok") == 2 and "[far-away]" in out
    assert "1 fan-out agent(s)" in err


@pytest.mark.timeout(180)
async def test_cluster_probe_reports_every_host_as_json(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    try:
        code, out, err = await _fdl(_project(tmp_path, server), "probe", "--json")
    finally:
        server.close()
    assert code == 0, err
    body = json.loads(out)
    assert [host["host"] for host in body["hosts"]] == ["controller 127.0.0.1", "far-away"]
    assert body["cluster"]["status"] == "ok" and body["hosts"][1]["facts"]["torch"]
