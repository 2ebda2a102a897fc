"""`fdl @cluster probe`: run `python -m flodld.probe --json` on every worker over SSH and collect.

Each remote probe runs where that worker's agent would run (its workdir, its interpreter, its
compose service), so a broken venv or a missing torch shows up here rather than at launch.
An unreachable host becomes a report with an `ssh` error instead of aborting the sweep.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex

from flodld.config.models import ClusterConfig, WorkerConfig
from flodld.fanout.launcher import endpoint_for, interpreter_for, workdir_for, wrap_command
from flodld.fanout.ssh import run_remote
from flodld.probe import HostReport, probe_local


def probe_command(worker: WorkerConfig, workdir: str, *, data_path: str | None) -> str:
    command = [interpreter_for(worker, workdir), "-m", "flodld.probe", "--json", "--host", worker.host]
    if data_path:
        command += ["--data-path", data_path]
    wrapped = wrap_command(worker, command, [])
    return f"cd {shlex.quote(workdir)} && " + " ".join(shlex.quote(part) for part in wrapped)


def parse_remote_report(host: str, code: int, out: str, err: str) -> HostReport:
    """The host's JSON report, or an error report saying what came back instead."""
    problem = f"no probe report (exit {code})"
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    if lines:
        try:
            report = HostReport.from_json(json.loads(lines[-1]))
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable probe report ({exc})"
        else:
            report.host = host
            return report
    report = HostReport(host=host)
    detail = (err.strip() or out.strip())[-400:] or "no output"
    report.add(
        "probe",
        "error",
        f"{problem}: {detail} — is flodld installed in that host's environment (see arch:/path:)?",
    )
    return report


async def probe_worker(worker: WorkerConfig, workdir: str, *, data_path: str | None,
                       timeout: float = 120.0) -> HostReport:  # fmt: skip
    try:
        code, out, err = await run_remote(
            endpoint_for(worker), probe_command(worker, workdir, data_path=data_path), timeout=timeout
        )
    except (ConnectionError, TimeoutError, OSError) as exc:
        report = HostReport(host=worker.host)
        report.add("ssh", "error", f"cannot run the probe over SSH: {exc or 'timed out'}")
        return report
    return parse_remote_report(worker.host, code, out, err)


async def probe_cluster(cluster: ClusterConfig, *, data_path: str | None = None) -> list[HostReport]:
    """The controller host (with its port) and every worker, remote ones in parallel."""
    controller = cluster.controller
    local_cwd = os.getcwd()
    port = controller.port or None
    reports = [probe_local(host=f"controller {controller.host}", data_path=data_path, port=port)]
    remote = [w for w in cluster.workers if not w.is_local(controller.host)]
    for worker in cluster.workers:
        if worker.is_local(controller.host):
            reports.append(probe_local(host=worker.host, data_path=data_path))
    reports += await asyncio.gather(
        *(probe_worker(w, workdir_for(w, controller, local_cwd), data_path=data_path) for w in remote)
    )
    return reports
