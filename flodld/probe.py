"""Readiness checks for one host (`fdl probe`) and their aggregation across a cluster.

The checks gather facts; `aggregate` applies the cross-host rules (NCCL major.minor skew,
torch major.minor skew). Exit status: non-zero on any error, zero on green or warnings only.
Run as `python -m flodld.probe [--json] [--data-path P] [--port N]` on a worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["ok", "warn", "error"]
_SEVERITY: dict[str, int] = {"ok": 0, "warn": 1, "error": 2}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass
class HostReport:
    host: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        worst = max((_SEVERITY[c.status] for c in self.checks), default=0)
        statuses: tuple[Status, ...] = ("ok", "warn", "error")
        return statuses[worst]

    def add(self, name: str, status: Status, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    def to_json(self) -> dict[str, object]:
        return {"host": self.host, "status": self.status, "facts": self.facts,
                "checks": [asdict(c) for c in self.checks]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, object]) -> HostReport:
        checks = data.get("checks", [])
        facts = data.get("facts", {})
        if not isinstance(checks, list) or not isinstance(facts, dict):
            raise ValueError("probe report: 'checks' must be a list and 'facts' an object")
        report = cls(host=str(data.get("host", "?")), facts={str(k): str(v) for k, v in facts.items()})
        for item in checks:
            status = str(item["status"])
            if status not in _SEVERITY:
                raise ValueError(f"probe report: unknown check status {status!r}")
            report.add(str(item["name"]), status, str(item["detail"]))  # type: ignore[arg-type]  # checked above
        return report


def _major_minor(version: str) -> str:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def probe_local(
    *, host: str | None = None, data_path: str | None = None, port: int | None = None
) -> HostReport:
    """Facts about this host: Python, torch build, devices, NCCL, gloo, a port, the data path."""
    report = HostReport(host=host or socket.gethostname())
    report.facts["python"] = platform.python_version()
    report.add("python", "ok", f"Python {platform.python_version()} at {sys.executable}")
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        report.add("torch", "error", f"torch is not importable: {exc}; install the project (make venv)")
        return report
    report.facts["torch"] = torch.__version__
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    report.add("torch", "ok", f"torch {torch.__version__} ({build})")
    report.add(
        "gloo",
        "ok" if dist.is_available() and dist.is_gloo_available() else "error",
        "gloo backend available" if dist.is_gloo_available() else "gloo backend missing from this torch",
    )
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report.facts["cuda_devices"] = ", ".join(names)
        report.add("cuda", "ok", f"{len(names)} CUDA device(s): {', '.join(names)}")
        if dist.is_nccl_available():
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]  # torch stub
            report.facts["nccl"] = nccl
            report.add("nccl", "ok", f"NCCL {nccl}")
        else:
            report.add(
                "nccl", "warn", "CUDA present but NCCL unavailable; only gloo (CPU averaging) will work"
            )
    else:
        report.facts["cuda_devices"] = ""
        report.add("cuda", "ok", f"no CUDA device; {os.cpu_count()} CPU core(s) for CPU ranks")
    if port is not None:
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("0.0.0.0", port))
            report.add("port", "ok", f"port {port} is free")
        except OSError as exc:
            report.add(
                "port", "error", f"port {port} cannot be bound: {exc.strerror}; pick another controller port"
            )
    if data_path:
        path = Path(data_path)
        if not path.is_dir():
            report.add("data_path", "error", f"shared data path {path} does not exist or is not a directory")
        elif not os.access(path, os.R_OK):
            report.add("data_path", "error", f"shared data path {path} is not readable by this user")
        else:
            report.add("data_path", "ok", f"shared data path {path} readable")
    return report


def aggregate(reports: list[HostReport]) -> HostReport:
    """Cross-host rules over per-host reports, as one pseudo-host report named 'cluster'."""
    summary = HostReport(host="cluster")
    nccl = {r.host: _major_minor(r.facts["nccl"]) for r in reports if r.facts.get("nccl")}
    if len(set(nccl.values())) > 1:
        listing = ", ".join(f"{h}: {v}" for h, v in sorted(nccl.items()))
        summary.add("nccl_skew", "error",
                    f"NCCL major.minor differs across hosts ({listing}); NCCL refuses the handshake — "
                    "build a matching libnccl on one side")  # fmt: skip
    torch_versions = {r.host: _major_minor(r.facts["torch"]) for r in reports if r.facts.get("torch")}
    if len(set(torch_versions.values())) > 1:
        listing = ", ".join(f"{h}: {v}" for h, v in sorted(torch_versions.items()))
        summary.add("torch_skew", "warn", f"torch major.minor differs across hosts ({listing})")
    for report in reports:
        if report.status == "error":
            failed = ", ".join(c.name for c in report.checks if c.status == "error")
            summary.add(f"host:{report.host}", "error", f"{report.host} failed: {failed}")
    if not summary.checks:
        summary.add("cluster", "ok", f"{len(reports)} host(s) ready")
    return summary


def render(reports: list[HostReport]) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "error": "FAIL"}
    lines: list[str] = []
    for report in reports:
        lines.append(f"{report.host}: {report.status}")
        lines.extend(f"  [{marks[c.status]}] {c.name}: {c.detail}" for c in report.checks)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodld.probe", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--host", help="name to report this host under")
    parser.add_argument("--data-path", help="shared data path that must be readable")
    parser.add_argument("--port", type=int, help="controller port that must be free")
    args = parser.parse_args(argv)
    report = probe_local(host=args.host, data_path=args.data_path, port=args.port)
    print(json.dumps(report.to_json()) if args.json else render([report]))
    return 1 if report.status == "error" else 0


if __name__ == "__main__":
    raise SystemExit(main())
