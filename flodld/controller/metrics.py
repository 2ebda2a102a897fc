"""Controller counters and their Prometheus text rendering.

Counters are plain integers mutated from the event loop thread only, so no locking. The
same numbers appear in state.json (under `controller`) and in /metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flodld.membership.phase import Phase

PHASES = tuple(phase.value for phase in Phase)
VERDICTS = (Phase.DONE.value, Phase.FAILED.value)


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


def _family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
        lines.append(f"{name}{{{label_text}}} {value:g}" if label_text else f"{name} {value:g}")
    return lines


def render_prometheus(
    counters: ControllerCounters,
    *,
    phase: str | None,
    joined_ranks: int,
    joined_hosts: int,
    run_id: str | None = None,
    runs: Mapping[str, int] | None = None,
) -> str:
    """Prometheus text exposition (version 0.0.4) of the run's phase and the controller counters.

    `runs`: finished runs by verdict since the daemon started (`flodld serve`; absent for a single run).
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
    labelled("flodld_bytes_received_total", "Frame bytes received, by channel.", "channel", counters.bytes_in)
    labelled("flodld_bytes_sent_total", "Frame bytes sent, by channel.", "channel", counters.bytes_out)
    return "\n".join(lines) + "\n"
