"""`fdl probe [--json]`: readiness of this host; `fdl @cluster probe`: every worker over SSH.

Checks Python, torch (version, build), CUDA devices and NCCL, gloo, the controller port and an
optional shared data path, and says what `fdl run` would start here (the `fdl_run` check and fact;
--devices, --nproc-per-node and --ranks ask about those flags of `fdl run`). With an overlay
selected the probe runs on every worker where its agent would run, then cross-host rules apply
(NCCL major.minor skew is an error). Silent when every check is green (a CI smoke test reads the
exit status); a warning or an error prints the whole report, and -v prints it always. Exit status: 0
green or warnings only, 1 any error, 2 bad usage (unreadable config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from fdl.cli import Command, usage_error
from fdl.runplan import add_rank_options, plan_run
from flodld import api

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable report (for CI gating)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print every check, also when all are green"
    )
    parser.add_argument("--data-path", help="shared data directory that must be readable on every host")
    parser.add_argument(
        "--port",
        type=int,
        help="port that must be free on this host (with @cluster: the controller port is checked)",
    )
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")
    add_rank_options(parser)


def _cluster(args: argparse.Namespace) -> api.ClusterConfig | None:
    """The selected overlay's cluster block, or None for a single-host probe."""
    env = getattr(args, "env", None) or os.environ.get("FDL_ENV") or None
    if env is None:
        return None
    return api.load_config(args.project, env).cluster


def collect(args: argparse.Namespace) -> list[api.HostReport]:
    cluster = _cluster(args)
    if cluster is None:
        report = api.probe_local(data_path=args.data_path, port=args.port)
        if report.facts.get("torch"):  # without torch, the torch check already says what to fix
            add_run_plan(report, args)
        return [report]
    return asyncio.run(api.probe_cluster(cluster, data_path=args.data_path))


def add_run_plan(report: api.HostReport, args: argparse.Namespace) -> None:
    """What `fdl run` (with the given rank flags) would start on this host, as the `fdl_run` check."""
    try:
        _, plan = plan_run(args)
    except ValueError as error:  # ConfigError and DeviceError too: `fdl run` would exit 2
        report.add("fdl_run", "error", f"`fdl run` would refuse to start (exit 2): {error}")
        return
    report.facts["fdl_run"] = plan
    report.add("fdl_run", "ok", f"`fdl run` would start {plan}")


def main(args: argparse.Namespace) -> int:
    try:
        reports = collect(args)
    except api.ConfigError as error:
        return usage_error("probe", error)
    summary = api.aggregate(reports) if len(reports) > 1 else None
    everything = reports + ([summary] if summary is not None else [])
    failed = any(report.status == "error" for report in everything)
    if args.json:
        worst = "error" if failed else ("warn" if any(r.status == "warn" for r in everything) else "ok")
        body: dict[str, object] = {"status": worst, "hosts": [r.to_json() for r in reports]}
        if summary is not None:
            body["cluster"] = summary.to_json()
        print(json.dumps(body, indent=2))
    elif args.verbose or any(report.status != "ok" for report in everything):
        print(api.render(everything))
    return EXIT_ERRORS if failed else EXIT_OK


COMMAND = Command(
    "probe", "readiness checks (this host, or every worker with @cluster)", __doc__, configure_parser, main
)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
