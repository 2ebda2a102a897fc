"""Helpers of bench/chaos.py: network-namespace hosts, process lookup, and the figures from the logs.

The figures are pure functions of what the run left behind: the ranks' round logs (bench/chaos_rank.py
writes one JSON line per round), the faults the driver injected (wall times), and the last state.json
the driver saw of the run (`losses`, and `joins` where the build has them).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class NetnsHosts:
    """One network namespace per host behind its own veth pair; the controller is reached at `address`
    (an address on this namespace's loopback, so it stays reachable while any one host's link is down).
    A partition is the host-side end of a pair taken down: no FIN, no RST.
    """

    hosts: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}")
    made: list[tuple[str, str]] = field(default_factory=list)  # ("netns"|"link"|"addr", name), in order

    @property
    def subnet(self) -> int:
        return 150 + os.getpid() % 50

    @property
    def address(self) -> str:
        return f"10.{self.subnet}.255.1"

    def namespace(self, index: int) -> str:
        return f"fch{self.tag}h{index}"

    def near(self, index: int) -> str:
        return f"fch{self.tag}n{index}"

    def build(self) -> None:
        ip("addr", "add", f"{self.address}/32", "dev", "lo")  # (no dummy interfaces in every kernel)
        self.made.append(("addr", f"{self.address}/32"))
        for index in range(self.hosts):
            ns, near, far = self.namespace(index), self.near(index), f"fch{self.tag}f{index}"
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            ip("link", "add", near, "type", "veth", "peer", "name", far)
            self.made.append(("link", near))
            ip("link", "set", far, "netns", ns)
            ip("addr", "add", f"10.{self.subnet}.{index}.1/24", "dev", near)
            ip("link", "set", near, "up")
            ip("-n", ns, "addr", "add", f"10.{self.subnet}.{index}.2/24", "dev", far)
            ip("-n", ns, "link", "set", far, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "default", "via", f"10.{self.subnet}.{index}.1")

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(index), *argv]

    def link(self, index: int, up: bool) -> None:
        ip("link", "set", self.near(index), "up" if up else "down")

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, then remove every namespace and link made."""
        for kind, name in reversed(self.made):
            if kind == "netns":
                listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
                for pid in listed.stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            elif kind == "addr":
                subprocess.run(["ip", "addr", "del", name, "dev", "lo"], capture_output=True, timeout=10)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=10)
        self.made.clear()


def marked_pids(mark: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries CHAOS_MARK=mark."""
    needle = f"CHAOS_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if (
                needle in Path(f"/proc/{entry}/environ").read_bytes()
                and "\nState:\tZ" not in Path(f"/proc/{entry}/status").read_text()
            ):
                found.append(int(entry))
        except OSError:
            continue
    return found


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's list)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def is_agent(pid: int) -> bool:
    """Whether `pid` is a flodld agent (`python -m flodld.agent`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"flodld.agent" in argv


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


# --- the figures ---------------------------------------------------------------------------------


@dataclass
class RankLog:
    rank: int
    host: str
    pid: int
    rounds: list[dict[str, Any]]


def machine(host: str) -> str:
    """The bench host a member host runs on: `h2` for `h2` and for `h2+1`, a slot of h2 healed in as a walk-in
    of its own (flodld/agent/heal.py).
    """
    return host.split("+", 1)[0]


def read_logs(directory: Path) -> list[RankLog]:
    """Every rank log of one run (a rank killed mid-line leaves a torn last line: skipped)."""
    logs = []
    for path in sorted(directory.glob("r*.jsonl")):
        header: dict[str, Any] | None = None
        rounds = []
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if line.get("header"):
                header = line
            else:
                rounds.append(line)
        if header is not None:
            logs.append(RankLog(header["rank"], header["host"], header["pid"], rounds))
    return logs


def read_last_rounds(directory: Path) -> list[RankLog]:
    """Every rank log of one run with its last round only (`rounds` has one entry, or none yet): what placing
    a fault needs. `read_logs` parses every round of every rank (about 150 a second each); done before every
    fault, late in a run that took the bench itself seconds of CPU on the 2-core machine it measures, and
    the chaos run's rate dipped before each fault for it.
    """
    logs = []
    for path in sorted(directory.glob("r*.jsonl")):
        try:
            with path.open("rb") as file:
                head = file.readline()
                end = file.seek(0, os.SEEK_END)
                file.seek(max(len(head), end - 4096))
                tail = file.read().splitlines()
            header = json.loads(head)
        except (OSError, json.JSONDecodeError):
            continue
        if not header.get("header"):
            continue
        last: list[dict[str, Any]] = []
        for text in reversed(tail):  # the first may be cut by the seek, the last torn by a kill: skipped
            with contextlib.suppress(json.JSONDecodeError):
                last = [json.loads(text)]
                break
        logs.append(RankLog(header["rank"], header["host"], header["pid"], last))
    return logs


@dataclass
class RunFigures:
    samples: int
    seconds: float
    window_rates: list[float]  # samples/s per window of the run
    rounds: int
    inconsistent: list[int]  # round numbers whose survivors hold different bytes
    smallest_world: int
    round_times: dict[int, float]  # round -> earliest arrival

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def run_figures(logs: list[RankLog], window: float) -> RunFigures:
    """Samples/s from the first round's arrival to the last one's, per `window` seconds too, and the
    rounds in which the survivors' averaged bytes differ. The first round's samples are not counted:
    they were trained before the clock starts (the ranks' start-up is not the run's throughput).
    """
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for log in logs:
        for line in log.rounds:
            by_round[line["round"]].append(line)
    if not by_round:
        return RunFigures(0, 0.0, [], 0, [], 0, {})
    times = {number: min(line["t"] for line in lines) for number, lines in by_round.items()}
    first, last = min(times.values()), max(line["t"] for lines in by_round.values() for line in lines)
    counted = [line for lines in by_round.values() for line in lines if line["t"] > first]
    buckets: dict[int, int] = defaultdict(int)
    for line in counted:
        buckets[math.ceil((line["t"] - first) / window) - 1] += line["samples"]  # the window it ends
    full = int((last - first) // window)  # whole windows only; the tail is too short to rate
    inconsistent = sorted(n for n, lines in by_round.items() if len({line["sha"] for line in lines}) > 1)
    return RunFigures(
        samples=sum(line["samples"] for line in counted),
        seconds=last - first,
        window_rates=[buckets[index] / window for index in range(full)],
        rounds=len(by_round),
        inconsistent=inconsistent,
        smallest_world=min(len(lines) for lines in by_round.values()),
        round_times=times,
    )


def pooled_rate(runs: list[RunFigures]) -> float:
    """Samples/s of `runs` taken as one: their samples over their seconds (a longer run weighs more)."""
    seconds = sum(run.seconds for run in runs)
    return sum(run.samples for run in runs) / seconds if seconds > 0 else 0.0


def round_arrivals(logs: list[RankLog]) -> dict[int, tuple[float, int]]:
    """Per round: its earliest arrival and how many ranks logged it (its members)."""
    arrivals: dict[int, tuple[float, int]] = {}
    for log in logs:
        for line in log.rounds:
            t, count = arrivals.get(line["round"], (line["t"], 0))
            arrivals[line["round"]] = (min(t, line["t"]), count + 1)
    return arrivals


def missing_rank_seconds(logs: list[RankLog], world: int) -> tuple[float, float]:
    """(rank-seconds the run trained with fewer than `world` ranks, the seconds from its first round to its
    last): each round's members (the ranks that logged it) held until the next round arrived.
    """
    ordered = sorted(round_arrivals(logs).values())
    missing = sum(
        max(0, world - count) * (later - t) for (t, count), (later, _) in itertools.pairwise(ordered)
    )
    return missing, (ordered[-1][0] - ordered[0][0]) if ordered else 0.0


@dataclass
class Fault:
    kind: str  # "agent SIGKILL", "rank SIGSTOP", "partition"
    host: str
    ranks: list[int]  # the ranks it takes out
    at: float  # wall time injected
    detected: float | None = None  # seconds to the first loss of one of `ranks` in state.json
    rejoined: float | None = None  # seconds to the host's first join after the fault (when joins exist)


def match_losses(faults: list[Fault], losses: list[dict[str, Any]], started_at: float) -> None:
    """Detection time of each fault: its injection to the first loss naming one of its ranks (state.json
    `losses`, whose `at_secs` count from the window's opening, `started_at` in unix seconds).
    """
    for fault in faults:
        times = [
            started_at + loss["at_secs"] - fault.at
            for loss in losses
            if loss["rank"] in fault.ranks and started_at + loss["at_secs"] >= fault.at - 1.0
        ]
        fault.detected = min(times) if times else None


def false_alarms(faults: list[Fault], losses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The losses declared by heartbeat silence of ranks no fault touched: what a liveness timeout too short
    for the machine costs (each one a healthy rank folded out, and its host back through its persist loop).
    """
    faulted = {rank for fault in faults for rank in fault.ranks}
    silent = [loss for loss in losses if "no heartbeat" in str(loss.get("cause"))]
    return [loss for loss in silent if loss["rank"] not in faulted]


def match_joins(
    faults: list[Fault], joins: list[dict[str, Any]], started_at: float, round_times: dict[int, float]
) -> None:
    """Rejoin time of each fault: its injection to the first later join on its host (state.json `joins`:
    the join's own time when it has one, else the arrival of the round it entered), a healed slot's included.
    """
    for fault in faults:
        times = []
        for join in joins:
            if machine(str(join.get("host"))) != fault.host:
                continue
            if isinstance(join.get("at_secs"), int | float):
                when = started_at + float(join["at_secs"])
            elif join.get("round") in round_times:
                when = round_times[join["round"]]
            else:
                continue
            if when > fault.at:
                times.append(when - fault.at)
        fault.rejoined = min(times) if times else None


def start_up_windows(
    joins: list[dict[str, Any]], started_at: float, round_times: dict[int, float]
) -> list[tuple[float, float]]:
    """Per walked-in host: from its admission (state.json `joins` `at_secs`) to the arrival of the round it
    entered at, the seconds its agent, relay and ranks start while the members train on (one window per
    host and entry round).
    """
    windows: dict[tuple[str, int], tuple[float, float]] = {}
    for join in joins:
        entered = round_times.get(join.get("round"))  # type: ignore[arg-type]
        if entered is None or not isinstance(join.get("at_secs"), int | float):
            continue
        windows[(str(join.get("host")), int(join["round"]))] = (started_at + float(join["at_secs"]), entered)
    return sorted(windows.values())


def attribute_loss(
    logs: list[RankLog], base_rate: float, windows: dict[str, list[tuple[float, float]]]
) -> dict[str, float]:
    """Where the chaos run's samples went missing, as shares of what the fault-free rate would have trained
    over the run (run_figures' span): per kind of window, the fault-free rate times the window's seconds
    less the samples trained in it (a second in windows of two kinds counts for the first kind named);
    `other`, the rest of the loss. Positive: samples lost.
    """
    lines = [line for log in logs for line in log.rounds]
    if not lines or base_rate <= 0:
        return {}
    first = min(line["t"] for line in lines)
    last = max(line["t"] for line in lines)
    expected = base_rate * (last - first)
    kinds = list(windows)

    def kind_of(t: float) -> str | None:
        return next((k for k in kinds if any(a <= t < b for a, b in windows[k])), None)

    spans: dict[str, float] = {}
    step = 0.01
    for index in range(int((last - first) / step)):
        kind = kind_of(first + (index + 0.5) * step)
        if kind is not None:
            spans[kind] = spans.get(kind, 0.0) + step
    trained: dict[str | None, int] = {}
    for line in lines:
        if line["t"] > first:
            kind = kind_of(line["t"])
            trained[kind] = trained.get(kind, 0) + line["samples"]
    shares = {k: (base_rate * spans.get(k, 0.0) - trained.get(k, 0)) / expected for k in kinds}
    total = (expected - sum(trained.values())) / expected
    shares["other"] = total - sum(shares.values())
    return shares


def quiet_pace(
    logs: list[RankLog], world: int, busy: list[tuple[float, float]], *, skip: float = 3.0
) -> float | None:
    """The machine's own pace in one run: the median rounds per second over its whole seconds in which every
    round had all `world` members and no `busy` window (a fault's and its aftermath's) began or ended, the
    run's first and last `skip` seconds left out. The same figure in every run of an invocation shows the
    shared machine's drift apart from the faults' cost: a chaos run whose quiet seconds ran slower than
    the fault-free runs' lost that part of its throughput to the machine, not to a fault. None: no such
    second.
    """
    members = round_arrivals(logs)
    if not members:
        return None
    first = min(t for t, _ in members.values())
    last = max(t for t, _ in members.values())
    seconds: dict[int, list[int]] = defaultdict(list)
    for t, count in members.values():
        seconds[int(t - first)].append(count)
    quiet = [
        len(counts)
        for second, counts in seconds.items()
        if skip <= second
        and first + second + 1 <= last - skip
        and min(counts) == world
        and not any(a < first + second + 1 and b > first + second for a, b in busy)
    ]
    return statistics.median(quiet) if quiet else None


def p50_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.0f}..{max(values):.0f}"
