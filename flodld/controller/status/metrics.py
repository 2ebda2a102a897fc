"""Controller counters and their Prometheus text rendering.

Counters are plain integers mutated from the event loop thread only, so no locking. The
same numbers appear in state.json (under `controller`) and in /metrics.

`RunMetrics` is the run's data-plane tally (sans-io: the data plane passes `now` in): rounds folded here
and how long each took, each rank's deposit delay and reported rounds, tensor bytes in and out. /metrics
renders it as it stands (O(ranks up to `RANK_SERIES_CAP`) per scrape, nothing recomputed from history).
docs/operations.md lists every family.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from flodld.membership.phase import Phase

PHASES = tuple(phase.value for phase in Phase)
VERDICTS = (Phase.DONE.value, Phase.FAILED.value)

RANK_SERIES_CAP: Final = 1024
"""Per-rank series exist for ranks 0 to 1023 only (bounded label cardinality); the run-wide families
still count every rank."""
ROUND_SECONDS_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds of `flodld_round_duration_seconds` (a +Inf bucket follows)."""
OPEN_ROUNDS_CAP: Final = 64
"""Rounds whose opening time is remembered at once (older ones are forgotten: their duration goes
unobserved)."""


@dataclass
class RankSeries:
    """One rank's numbers in `RunMetrics`."""

    rounds: int = 0  # rounds the rank reported completed (its heartbeat `step`)
    delay_sum: float = 0.0  # seconds, over the rounds its deposit reached the controller's fold
    delay_count: int = 0
    last_delay: float = 0.0
    skipped: int = 0  # rounds that closed without its deposit (straggler_timeout)


class RunMetrics:
    """One run's data-plane numbers (sans-io: every call gets `now`; the data plane calls it).

    A round opens at the controller when the first host's first chunk of it arrives; each rank's deposit
    delay is the time from that opening to the arrival of the first chunk carrying the rank (its host's
    partial fold), so the rank that arrives first waits 0 s and a straggler shows how long the others
    waited for it. A round's duration runs from its opening to its last chunk's broadcast. In a world of
    one host the relay folds every round itself: no round passes here and only the heartbeat-reported
    rounds per rank move.
    """

    def __init__(self) -> None:
        self.rounds = 0
        self.round_buckets = [0] * len(ROUND_SECONDS_BUCKETS)  # not cumulative: observations per bucket
        self.round_seconds_sum = 0.0
        self.round_seconds_count = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.dead_ranks = 0
        # Heartbeats: the limits the plane runs with, and the longest silence a live rank ended by speaking
        # again (the margin left under the timeout; state.json `heartbeats`).
        self.liveness_timeout: float | None = None
        self.heartbeat_interval: float | None = None
        self.longest_gap = 0.0
        self.longest_gap_rank: int | None = None
        self.ranks: dict[int, RankSeries] = {}
        self._opened: dict[int, float] = {}

    def _rank(self, rank: int) -> RankSeries | None:
        if not 0 <= rank < RANK_SERIES_CAP:
            return None
        series = self.ranks.get(rank)
        if series is None:
            series = self.ranks[rank] = RankSeries()
        return series

    def host_chunk(
        self, round_number: int, offset: int, contributors: Iterable[int], nbytes: int, now: float
    ) -> None:
        """A host frame chunk arrived: `nbytes` tensor bytes; at offset 0 its contributors' deposits."""
        self.bytes_received += nbytes
        if offset != 0:
            return
        opened = self._opened.get(round_number)
        if opened is None:
            if len(self._opened) >= OPEN_ROUNDS_CAP:
                del self._opened[min(self._opened)]
            opened = self._opened[round_number] = now
        delay = max(0.0, now - opened)
        for rank in contributors:
            series = self._rank(rank)
            if series is not None:
                series.delay_sum += delay
                series.delay_count += 1
                series.last_delay = delay

    def round_finished(self, round_number: int, now: float) -> None:
        """The round's last chunk was folded and goes down to every relay."""
        self.rounds += 1
        opened = self._opened.pop(round_number, None)
        if opened is None:
            return
        seconds = max(0.0, now - opened)
        self.round_seconds_sum += seconds
        self.round_seconds_count += 1
        for index, bound in enumerate(ROUND_SECONDS_BUCKETS):
            if seconds <= bound:
                self.round_buckets[index] += 1
                break

    def sent(self, nbytes: int) -> None:
        """Tensor bytes of one Broadcast chunk written to one relay."""
        self.bytes_sent += nbytes

    def heartbeat(self, rank: int, step: int, gap: float | None = None) -> bool:
        """A rank's heartbeat: `step` is its count of completed rounds (it never goes down); `gap`, the
        silence it ended (None: its first). True when that gap is the run's longest yet.
        """
        longest = False
        if gap is not None and gap > self.longest_gap:
            self.longest_gap, self.longest_gap_rank, longest = gap, rank, True
        series = self._rank(rank)
        if series is not None and step > series.rounds:
            series.rounds = step
        return longest

    def skipped(self, rank: int) -> None:
        """A round closed without `rank`'s deposit (late past the straggler timeout; it stays a member)."""
        series = self._rank(rank)
        if series is not None:
            series.skipped += 1

    def rank_dead(self) -> None:
        self.dead_ranks += 1

    def slowest(self, count: int) -> list[dict[str, float | int]]:
        """The `count` ranks whose deposits reached the fold latest on average (state.json `stragglers`):
        rank, mean and last delay after their round opened, rounds timed, and rounds that closed without
        it (`skipped`, straggler_timeout); the most skipped first, then the slowest.
        """
        timed = [
            (rank, series) for rank, series in self.ranks.items() if series.delay_count or series.skipped
        ]
        timed.sort(key=lambda item: (-item[1].skipped, -_mean_delay(item[1]), item[0]))
        return [
            {
                "rank": rank,
                "mean_delay_secs": round(_mean_delay(series), 4),
                "last_delay_secs": round(series.last_delay, 4),
                "rounds": series.delay_count,
                "skipped": series.skipped,
            }
            for rank, series in timed[:count]
        ]


    def heartbeats(self) -> dict[str, float | int] | None:
        """state.json `heartbeats`: the timeout and interval, and the longest gap a live rank's heartbeats
        left (with its rank); None before the plane set its limits or heard a rank twice.
        """
        if self.liveness_timeout is None or self.heartbeat_interval is None or self.longest_gap_rank is None:
            return None
        return {
            "timeout_secs": self.liveness_timeout,
            "interval_secs": self.heartbeat_interval,
            "longest_gap_secs": round(self.longest_gap, 4),
            "longest_gap_rank": self.longest_gap_rank,
        }


def _mean_delay(series: RankSeries) -> float:
    return series.delay_sum / series.delay_count if series.delay_count else 0.0


@dataclass(frozen=True)
class RunSeries:
    """What /metrics shows about one run (labelled with its id); `data` is its data-plane tally."""

    run_id: str
    restarts: int
    max_restarts: int
    admitted_hosts: int
    admitted_ranks: int
    lost_ranks: int
    data: RunMetrics


@dataclass
class ControllerCounters:
    """What the mux and the channel handlers have seen since the port opened."""

    connections: Counter[str] = field(default_factory=Counter)  # by channel ("join", "http", ...)
    dropped: Counter[str] = field(default_factory=Counter)  # by reason ("unknown_magic", "deadline", ...)
    refusals: Counter[str] = field(default_factory=Counter)  # join refusals by reason code
    frames_in: Counter[str] = field(default_factory=Counter)  # by channel
    frames_out: Counter[str] = field(default_factory=Counter)
    bytes_in: Counter[str] = field(default_factory=Counter)
    bytes_out: Counter[str] = field(default_factory=Counter)
    last_http_at: float | None = None  # the event loop's time of the last HTTP connection routed

    def frame_in(self, channel: str, size: int) -> None:
        self.frames_in[channel] += 1
        self.bytes_in[channel] += size

    def frame_out(self, channel: str, size: int) -> None:
        self.frames_out[channel] += 1
        self.bytes_out[channel] += size

    def as_json(self) -> dict[str, dict[str, int]]:
        return {
            "connections": dict(self.connections),
            "dropped": dict(self.dropped),
            "refusals": dict(self.refusals),
            "frames_in": dict(self.frames_in),
            "frames_out": dict(self.frames_out),
            "bytes_in": dict(self.bytes_in),
            "bytes_out": dict(self.bytes_out),
        }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """A sample value: integers exactly (a byte counter past 1e6 must not lose digits), else repr."""
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _family(
    name: str,
    kind: str,
    help_text: str,
    samples: Iterable[tuple[Mapping[str, str], float]],
    *,
    suffixed: Iterable[tuple[str, Mapping[str, str], float]] = (),
) -> list[str]:
    """`samples` are named `name`; `suffixed` (suffix, labels, value) are a histogram's or summary's
    `name_bucket`, `name_sum`, `name_count` samples.
    """
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    rows = [("", labels, value) for labels, value in samples]
    for suffix, labels, value in [*rows, *suffixed]:
        label_text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
        sample = f"{name}{suffix}"
        lines.append(
            f"{sample}{{{label_text}}} {_number(value)}" if label_text else f"{sample} {_number(value)}"
        )
    return lines


# The run's one-sample families, labelled with its id, in exposition order: (name, type, help, value).
_RunScalar = tuple[str, str, str, Callable[[RunSeries], float]]
_RUN_SCALARS: tuple[_RunScalar, ...] = (
    (
        "flodld_run_restarts",
        "gauge",
        "Restarts made before this attempt (0 for the first attempt of fdl run --max-restarts).",
        lambda run: run.restarts,
    ),
    (
        "flodld_run_max_restarts",
        "gauge",
        "Restarts the run may still make in all (--max-restarts).",
        lambda run: run.max_restarts,
    ),
    (
        "flodld_join_admissions_total",
        "counter",
        "Hosts admitted by the run's join window.",
        lambda run: run.admitted_hosts,
    ),
    (
        "flodld_join_admitted_ranks_total",
        "counter",
        "Ranks handed out by the run's join window.",
        lambda run: run.admitted_ranks,
    ),
    (
        "flodld_lost_ranks",
        "gauge",
        "Ranks that exited non-zero or whose host was lost before reporting them.",
        lambda run: run.lost_ranks,
    ),
    (
        "flodld_ranks_declared_dead_total",
        "counter",
        "Ranks the data plane declared dead after a heartbeat timeout.",
        lambda run: run.data.dead_ranks,
    ),
    (
        "flodld_heartbeat_longest_gap_seconds",
        "gauge",
        "The longest silence between two heartbeats of one rank that spoke again (keep the liveness "
        "timeout well above it).",
        lambda run: run.data.longest_gap,
    ),
    (
        "flodld_rounds_total",
        "counter",
        "Averaging rounds folded by the controller (0 in a one-host world: its relay folds).",
        lambda run: run.data.rounds,
    ),
)
# The same after the round-duration histogram.
_DATAPLANE_SCALARS: tuple[_RunScalar, ...] = (
    (
        "flodld_dataplane_received_bytes_total",
        "counter",
        "Tensor bytes of host frames received.",
        lambda run: run.data.bytes_received,
    ),
    (
        "flodld_dataplane_sent_bytes_total",
        "counter",
        "Tensor bytes of broadcast chunks sent to relays.",
        lambda run: run.data.bytes_sent,
    ),
)


def _scalar_families(run: RunSeries, scalars: Iterable[_RunScalar]) -> list[str]:
    who = {"run_id": run.run_id}
    lines: list[str] = []
    for name, kind, help_text, value in scalars:
        lines += _family(name, kind, help_text, [(who, value(run))])
    return lines


def _run_families(run: RunSeries) -> list[str]:
    """The per-run and per-rank families of `run` (docs/operations.md, "Metrics")."""
    data, who = run.data, {"run_id": run.run_id}
    lines = _scalar_families(run, _RUN_SCALARS)
    cumulative, buckets = 0, []
    for bound, count in zip(ROUND_SECONDS_BUCKETS, data.round_buckets, strict=True):
        cumulative += count
        buckets.append(("_bucket", {**who, "le": _number(bound)}, cumulative))
    buckets.append(("_bucket", {**who, "le": "+Inf"}, data.round_seconds_count))
    lines += _family(
        "flodld_round_duration_seconds",
        "histogram",
        "Seconds from a round's first deposit at the controller to its last broadcast chunk.",
        [],
        suffixed=[*buckets, ("_sum", who, data.round_seconds_sum), ("_count", who, data.round_seconds_count)],
    )
    lines += _scalar_families(run, _DATAPLANE_SCALARS)
    ranks = sorted(data.ranks.items())
    lines += _family(
        "flodld_rank_rounds_total",
        "counter",
        "Rounds the rank reported completed (its heartbeat step); ranks below 1024 only.",
        (({**who, "rank": str(rank)}, series.rounds) for rank, series in ranks),
    )
    delays: list[tuple[str, Mapping[str, str], float]] = []
    for rank, series in ranks:
        if series.delay_count:
            labels = {**who, "rank": str(rank)}
            delays += [("_sum", labels, series.delay_sum), ("_count", labels, series.delay_count)]
    lines += _family(
        "flodld_rank_deposit_delay_seconds",
        "summary",
        "Seconds from a round's first deposit at the controller to this rank's; ranks below 1024 only.",
        [],
        suffixed=delays,
    )
    lines += _family(
        "flodld_rank_last_deposit_delay_seconds",
        "gauge",
        "The rank's deposit delay in the last round it deposited in; ranks below 1024 only.",
        (({**who, "rank": str(rank)}, series.last_delay) for rank, series in ranks if series.delay_count),
    )
    return lines


def render_prometheus(
    counters: ControllerCounters,
    *,
    phase: str | None,
    joined_ranks: int,
    joined_hosts: int,
    run_id: str | None = None,
    runs: Mapping[str, int] | None = None,
    run: RunSeries | None = None,
) -> str:
    """Prometheus text exposition (version 0.0.4) of the run's phase and the controller counters.

    `runs`: finished runs by verdict since the daemon started (`flodld serve`; absent for a single run).
    `run`: the current (or last) run's own families, labelled with its id.
    """
    lines: list[str] = []
    lines += _family(
        "flodld_phase",
        "gauge",
        "1 for the run's current lifecycle phase, 0 for the others.",
        (({"phase": p}, 1.0 if p == phase else 0.0) for p in PHASES),
    )
    if run_id is not None:
        lines += _family(
            "flodld_run_info",
            "gauge",
            "The current (or last) run's id, as a label.",
            [({"run_id": run_id}, 1.0)],
        )
    if runs is not None:
        lines += _family(
            "flodld_runs_total",
            "counter",
            "Finished runs since the daemon started, by verdict.",
            (({"verdict": v}, runs.get(v, 0)) for v in VERDICTS),
        )
    lines += _family("flodld_joined_ranks", "gauge", "Ranks admitted to the run.", [({}, joined_ranks)])
    lines += _family("flodld_joined_hosts", "gauge", "Hosts admitted to the run.", [({}, joined_hosts)])

    def labelled(name: str, help_text: str, label: str, counter: Counter[str]) -> None:
        lines.extend(
            _family(
                name, "counter", help_text, (({label: key}, value) for key, value in sorted(counter.items()))
            )
        )

    labelled("flodld_join_refusals_total", "Join attempts refused, by reason.", "reason", counters.refusals)
    labelled("flodld_connections_total", "Connections routed, by channel.", "channel", counters.connections)
    labelled(
        "flodld_dropped_connections_total",
        "Connections dropped before routing, by reason.",
        "reason",
        counters.dropped,
    )
    labelled("flodld_frames_received_total", "Frames received, by channel.", "channel", counters.frames_in)
    labelled("flodld_frames_sent_total", "Frames sent, by channel.", "channel", counters.frames_out)
    labelled("flodld_received_bytes_total", "Frame bytes received, by channel.", "channel", counters.bytes_in)
    labelled("flodld_sent_bytes_total", "Frame bytes sent, by channel.", "channel", counters.bytes_out)
    if run is not None:
        lines += _run_families(run)
    return "\n".join(lines) + "\n"
