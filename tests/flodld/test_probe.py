"""`fdl probe` checks on this host and the cross-host aggregation rules."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from flodld.probe import HostReport, aggregate, probe_local


def _host(name: str, **facts: str) -> HostReport:
    report = HostReport(host=name, facts=dict(facts))
    report.add("python", "ok", "fine")
    return report


def test_local_probe_reports_python_torch_and_gloo(tmp_path: Path) -> None:
    report = probe_local(host="me", data_path=str(tmp_path))
    names = {c.name: c.status for c in report.checks}
    assert names["python"] == names["torch"] == names["gloo"] == names["data_path"] == "ok"
    assert report.status == "ok"
    assert report.facts["torch"]


def test_missing_data_path_is_an_error() -> None:
    report = probe_local(data_path="/definitely/not/here")
    assert report.status == "error"
    assert any("does not exist" in c.detail for c in report.checks if c.name == "data_path")


def test_busy_port_is_an_error() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        report = probe_local(port=port)
    assert [c.status for c in report.checks if c.name == "port"] == ["error"]


def test_nccl_major_minor_skew_is_a_cluster_error() -> None:
    summary = aggregate(
        [_host("a", nccl="2.27.3", torch="2.13.0"), _host("b", nccl="2.26.5", torch="2.13.0")]
    )
    assert summary.status == "error"
    assert "a: 2.27" in summary.checks[0].detail and "b: 2.26" in summary.checks[0].detail


def test_same_nccl_minor_with_different_patch_is_fine() -> None:
    summary = aggregate([_host("a", nccl="2.27.3"), _host("b", nccl="2.27.7")])
    assert summary.status == "ok"


def test_torch_skew_is_only_a_warning() -> None:
    assert aggregate([_host("a", torch="2.13.0"), _host("b", torch="2.12.1")]).status == "warn"


def test_a_failed_host_fails_the_cluster() -> None:
    bad = _host("b")
    bad.add("gloo", "error", "missing")
    summary = aggregate([_host("a"), bad])
    assert summary.status == "error" and "b failed: gloo" in summary.checks[0].detail


def test_module_cli_json_round_trips_and_exit_codes(tmp_path: Path) -> None:
    good = subprocess.run([sys.executable, "-m", "flodld.probe", "--json", "--data-path", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert good.returncode == 0, good.stderr
    parsed = HostReport.from_json(json.loads(good.stdout))
    assert parsed.status == "ok"
    bad = subprocess.run([sys.executable, "-m", "flodld.probe", "--data-path", "/nope"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and "FAIL" in bad.stdout
