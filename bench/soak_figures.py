"""The soak's figures: what it samples of the controller per run, and the report it prints."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Figures:
    state_latency: list[float] = field(default_factory=list)
    join_latency: list[float] = field(default_factory=list)
    run_latency: list[float] = field(default_factory=list)
    real_run_latency: list[float] = field(default_factory=list)
    kill_to_verdict: list[float] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    verdicts_right: int = 0
    verdicts_wrong: list[str] = field(default_factory=list)


def sample(pid: int, figures: Figures) -> None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            figures.rss.append(int(line.split()[1]) * 1024)
    figures.fds.append(len(os.listdir(f"/proc/{pid}/fd")))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")



def report(
    args: argparse.Namespace, figures: Figures, quiet: list[float], elapsed: float, real_hosts: int
) -> None:
    """The soak's figures, printed: runs and verdicts, the controller's RSS and descriptors, latencies."""
    ms = 1e3
    runs = figures.verdicts_right + len(figures.verdicts_wrong)
    print(
        f"soak: {runs} runs completed in {elapsed:.1f}s ({args.runs} protocol runs of {args.hosts} hosts + "
        f"{args.leavers} leavers, {args.real_runs} real runs of {real_hosts} agents; {args.pollers} pollers, "
        f"kill rate {args.kill_rate})"
    )
    print(f"verdicts: {figures.verdicts_right}/{runs} correct")
    for wrong in figures.verdicts_wrong[:10]:
        print(f"  WRONG {wrong}")
    rss_mib = [value / 2**20 for value in figures.rss]
    print(
        f"controller RSS MiB: baseline {rss_mib[0]:.1f}, first run {rss_mib[1]:.1f}, max {max(rss_mib):.1f}, "
        f"last {rss_mib[-1]:.1f}"
    )
    print(
        f"controller fds: baseline {figures.fds[0]}, first run {figures.fds[1]}, max {max(figures.fds)}, "
        f"last {figures.fds[-1]}"
    )
    protocol = figures.rss[1 : args.runs + 1]  # sample 0 is the baseline; real runs come last
    head, tail = protocol[:5], protocol[-5:]
    growth = (statistics.mean(tail) - statistics.mean(head)) / 2**20
    print(
        f"RSS growth over the protocol runs, mean of the last 5 minus the first 5: {growth:+.1f} MiB; "
        f"fd growth over all runs {figures.fds[-1] - figures.fds[1]:+d}"
    )
    marks = sorted({1, *(max(1, round(args.runs * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0))})
    print(
        "RSS MiB after protocol run "
        + ", ".join(f"{m}: {figures.rss[m] / 2**20:.1f}" for m in marks if m < len(figures.rss))
    )
    if args.real_runs >= 2:
        real = [value / 2**20 for value in figures.rss[args.runs + 1 :]]
        print(f"RSS after each real run (data plane included), MiB: {', '.join(f'{v:.1f}' for v in real)}")
    print(
        f"orphan processes after real runs: {len(figures.orphans)}"
        + "".join(f"\n  ORPHANS {line}" for line in figures.orphans)
    )
    for name, values in (
        ("state.json", figures.state_latency),
        ("join", figures.join_latency),
        ("run", figures.run_latency),
        ("real run", figures.real_run_latency),
        ("kill->verdict", figures.kill_to_verdict),
    ):
        if not values:
            continue
        print(
            f"{name:>13}: n={len(values):5d} p50 {percentile(values, 0.5) * ms:8.2f} ms  "
            f"p99 {percentile(values, 0.99) * ms:8.2f} ms  max {max(values) * ms:8.2f} ms"
        )
    quiet_p99 = percentile(quiet, 0.99)
    print(
        f"state.json p99 under soak / quiet baseline p99 ({quiet_p99 * ms:.2f} ms): "
        f"{percentile(figures.state_latency, 0.99) / quiet_p99:.2f}x"
    )
