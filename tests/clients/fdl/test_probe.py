"""`fdl probe` and `fdl @cluster probe` (the remote leg through an in-process asyncssh server)."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest
from fdl import probe as probe_command

from flodld.config.builder import ClusterBuilder
from flodld.fanout.remote_probe import parse_remote_report, probe_cluster
from flodld.fanout.remote_probe import probe_command as remote_command
from tests.flodld.fanout.sshserver import start_local_ssh_server

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _args(**values: object) -> argparse.Namespace:
    defaults: dict[str, object] = {"json": True, "data_path": None, "port": None, "project": "."}
    defaults |= {"env": None, "verbose": False}
    defaults.update(values)
    return argparse.Namespace(**defaults)


def test_single_host_probe_prints_json_and_exits_zero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert probe_command.main(_args(data_path=str(tmp_path))) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["status"] == "ok" and body["hosts"][0]["facts"]["torch"]


def test_single_host_probe_fails_on_a_missing_data_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe_command.main(_args(json=False, data_path="/no/such/path")) == 1
    assert "FAIL" in capsys.readouterr().out


def test_single_host_probe_is_silent_when_green_and_verbose_with_v(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert probe_command.main(_args(json=False, data_path=str(tmp_path))) == 0
    assert capsys.readouterr().out == ""
    assert probe_command.main(_args(json=False, data_path=str(tmp_path), verbose=True)) == 0
    out = capsys.readouterr().out
    assert "[ok  ] python:" in out and "[ok  ] data_path:" in out


def test_cluster_probe_reads_the_overlay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fdl.yml").write_text("join:\n  address: 127.0.0.1\n")
    (tmp_path / "fdl.lab.yml").write_text(
        "cluster:\n  controller: {host: 127.0.0.1, port: 0}\n"
        "  workers:\n    - {host: localhost, local_devices: [cpu]}\n"
    )
    assert probe_command.main(_args(project=str(tmp_path), env="lab")) == 0
    body = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in body["hosts"]] == ["controller 127.0.0.1", "localhost"]
    assert body["cluster"]["status"] == "ok"


@pytest.mark.timeout(120)
async def test_cluster_probe_runs_the_module_on_each_worker_over_ssh(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    ssh = {"target": "127.0.0.1", "port": server.port, "identity_file": str(server.client_key_path),
           "options": ["StrictHostKeyChecking=no"]}  # fmt: skip
    cluster = (ClusterBuilder().controller("127.0.0.1", _free_port())
               .worker("far-a", ["cpu"], ssh=ssh, path=str(REPO))
               .worker("far-b", ["cpu"], ssh=ssh, path=str(tmp_path / "missing"))
               .build())  # fmt: skip
    try:
        reports = await probe_cluster(cluster, data_path=str(tmp_path))
    finally:
        server.close()
    by_host = {r.host: r for r in reports}
    assert by_host["far-a"].status == "ok" and by_host["far-a"].facts["torch"]
    assert by_host["far-b"].status == "error"
    assert "no probe report" in by_host["far-b"].checks[0].detail


def test_remote_probe_command_runs_in_the_workdir_with_the_worker_interpreter() -> None:
    worker = (
        ClusterBuilder()
        .controller("h", 1337)
        .worker("w", ["cpu"], path="/srv/x", arch="envs/a")
        .build()
        .workers[0]
    )
    command = remote_command(worker, "/srv/x", data_path="/data")
    assert (
        command == "cd /srv/x && /srv/x/envs/a/bin/python -m flodld.probe --json --host w --data-path /data"
    )


def test_garbage_from_a_host_becomes_an_error_report() -> None:
    report = parse_remote_report("w", 127, "", "bash: python: command not found")
    assert report.status == "error" and "command not found" in report.checks[0].detail
    broken = parse_remote_report("w", 0, '{"checks": 5}', "")
    assert broken.status == "error" and "unreadable" in broken.checks[0].detail
