"""The join storm's figures: what it reads of the machine (/proc) around a storm, its row, and the table.

Linux /proc only; a figure that cannot be read is NaN (or -1, or left out), never an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_secs(pid: int) -> float:
    """User + system CPU seconds the process has used so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


# Kernel TCP counters worth a look around a storm (namespace-wide: other traffic on the machine counts too).
# A SYN or final ACK the kernel drops (full SYN or accept queue) costs the dialer a 1 s retransmission.
_KERNEL_COUNTERS = (
    ("TcpExt", "ListenOverflows"),
    ("TcpExt", "ListenDrops"),
    ("TcpExt", "TCPReqQFullDrop"),
    ("TcpExt", "SyncookiesSent"),
    ("TcpExt", "TCPSynRetrans"),
    ("TcpExt", "TCPTimeouts"),
    ("Tcp", "RetransSegs"),
)


def sockets_in_time_wait() -> int:
    """TCP sockets in TIME_WAIT, namespace-wide (/proc/net/sockstat `tw`; -1 where it cannot be read).

    Each closed connection leaves one for 60 s on the side that closed first, and this bench closes tens of
    thousands (baselines, agents): with ~100,000 of them, connect() hunts for a free ephemeral port among
    `ip_local_port_range`'s 28,232 and the simulated agents' CPU per admission rises by a third, which a
    back-to-back series of runs shows as a falling ratio. Printed per row; let them drain (a minute) between
    runs that are to be compared.
    """
    try:
        for line in Path("/proc/net/sockstat").read_text().splitlines():
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("tw") + 1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def kernel_counters() -> dict[str, int]:
    """The `_KERNEL_COUNTERS` from /proc/net/netstat and /proc/net/snmp (empty where they cannot be read)."""
    found: dict[str, int] = {}
    for name in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for header, values in zip(lines[::2], lines[1::2], strict=False):
            prefix, _, keys = header.partition(":")
            for key, value in zip(keys.split(), values.partition(":")[2].split(), strict=False):
                if (prefix, key) in _KERNEL_COUNTERS:
                    found[key] = int(value)
    return found


@dataclass
class MachineCpu:
    """CPU seconds the whole machine spent busy, and stolen by the hypervisor, since boot (/proc/stat)."""

    busy: float
    steal: float

    @staticmethod
    def now() -> MachineCpu:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return MachineCpu(float("nan"), float("nan"))
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return MachineCpu((user + nice + system + irq + softirq) / tick, steal / tick)


def others_share(before: MachineCpu, after: MachineCpu, own_secs: float, wall: float) -> tuple[float, float]:
    """(CPU the rest of the machine used, CPU stolen) over `wall` seconds, as fractions of all its cores.

    `own_secs` is what the bench's own processes used; the rest is other work on the same cores, which on a
    shared machine sets the rates more than the code does.
    """
    cores = os.cpu_count() or 1
    others = max(0.0, after.busy - before.busy - own_secs)
    return others / (wall * cores), (after.steal - before.steal) / (wall * cores)


def percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


@dataclass
class StormRow:
    agents: int
    admit_rate: float
    baseline_rate: float
    first_dial_to_formed_ms: float
    last_accept_to_formed_ms: float
    state_p50: float
    state_p99: float
    base_p50: float
    base_p99: float
    polls: int
    idle_rss: float
    peak_rss: float
    formed_bytes: int
    exit_code: int | None
    controller_cpu_secs: float = float("nan")
    agents_cpu_secs: float = float("nan")
    """The controller's CPU from the first dial to the last WorldFormed (pollers' requests included)."""
    others_storm: float = float("nan")
    """The share of the machine's cores other work used during the storm (not the controller, this process
    or the pollers)."""
    steal_storm: float = float("nan")
    others_baseline: float = float("nan")
    """The same during the connect+echo baseline (not this process)."""
    baseline_apart_rate: float = float("nan")
    """The connect+echo baseline with its server in a process of its own."""
    kernel: dict[str, int] = field(default_factory=dict)
    """The kernel's TCP drop and retransmission counters: their increase over the storm."""
    time_wait: int = -1
    """TCP sockets in TIME_WAIT when the storm began (/proc/net/sockstat; -1: not readable)."""

    @property
    def per_host_bytes(self) -> float:
        return (self.peak_rss - self.idle_rss) * 1024 * 1024 / self.agents



def table(rows: list[StormRow]) -> str:
    lines = [
        "| agents | admissions/s (TCP connect+echo baseline, ratio) | first dial → formed | last accept → "
        "formed | state.json p50 / p99 (404 baseline p50 / p99, polls) | controller RSS linked (idle) | RSS "
        "per host | WorldFormed bytes per host | controller CPU per admission | agents' CPU per admission | "
        "exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.agents:,} | {r.admit_rate:,.0f} ({r.baseline_rate:,.0f}, "
            f"{r.admit_rate / r.baseline_rate:.2f}) | {r.first_dial_to_formed_ms:,.0f} ms | "
            f"{r.last_accept_to_formed_ms:,.0f} ms | {r.state_p50:,.1f} / {r.state_p99:,.1f} ms "
            f"({r.base_p50:,.1f} / {r.base_p99:,.1f} ms, {r.polls}) | {r.peak_rss:,.0f} MiB "
            f"({r.idle_rss:,.0f} MiB) | {r.per_host_bytes / 1024:,.1f} KiB | {r.formed_bytes} B | "
            f"{r.controller_cpu_secs / r.agents * 1e6:,.0f} µs | "
            f"{r.agents_cpu_secs / r.agents * 1e6:,.0f} µs | {r.exit_code} |"
        )
    return "\n".join(lines)


# Other work's share of the cores during a storm above which the row is marked contended: a storm needs
# both cores of a two-core machine (the controller one, the simulated agents most of the other), so other
# work on half a core or more sets its rate and its latencies (2026-12-03, 20 runs at 10,000 agents: the four
# slow ones, 0.30-0.39 of the baseline, were the four where other work held 32-45 % of the cores; 0-4 % in
# the others, 0.51-0.62).
CONTENDED_SHARE = 0.25


def machine_line(row: StormRow) -> str:
    """What else ran on the machine during the storm and its baseline, and what the kernel dropped."""
    kernel = ", ".join(f"{key} +{value}" for key, value in row.kernel.items()) or "not readable"
    contended = (
        f"CONTENDED (other work held {row.others_storm:.0%} of the cores during the storm: this row measures "
        "the machine more than the controller); "
        if row.others_storm >= CONTENDED_SHARE
        else ""
    )
    return contended + (
        f"connect+echo with the echo server in a process of its own {row.baseline_apart_rate:,.0f}/s "
        f"(ratio {row.admit_rate / row.baseline_apart_rate:.2f}); "
        f"other work used {row.others_storm:.0%} of the machine's cores during the storm (steal "
        f"{row.steal_storm:.0%}), {row.others_baseline:.0%} during the baseline; "
        f"{row.time_wait:,} TCP sockets in TIME_WAIT when the storm began; kernel TCP counters: {kernel}"
    )
