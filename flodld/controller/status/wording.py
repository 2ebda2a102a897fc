"""Plain-text wordings of state.json values: countdowns, durations, rank lists, devices, times and the run
history's summaries. Pure functions of the values (no clock: a time is the value's own), the formatters of
the summariser (`summary.py`) and of the status page (`flodld.controller.status.page`, which escapes what
they return); no HTML here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any


def fmt_secs(value: object) -> str:
    """A countdown as a person reads it: 42s, 3m 05s, 2h 07m."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "—"
    secs = max(0, int(value))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m {secs % 60:02d}s"
    return f"{secs // 3600}h {secs % 3600 // 60:02d}m"


def fmt_duration(value: object) -> str:
    """How long something took: tenths under a minute (0.9s, 42.5s), then as `fmt_secs` (12m 34s)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 60:
        return f"{int(value * 10) / 10:.1f}s"  # truncated, as fmt_secs truncates
    return fmt_secs(value)


def fmt_ranks(ranks: Iterable[object]) -> str:
    """[0, 1, 2, 3, 7] -> '0–3, 7' (contiguous runs collapsed)."""
    values = sorted(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}–{values[j]}")
        i = j + 1
    return ", ".join(parts) or "—"


def fmt_devices(member: Mapping[str, Any]) -> str:
    """A member's devices: '4× cpu' when all alike, else each label."""
    labels = [str(d) for d in (member.get("device_labels") or member.get("devices") or [])]
    if not labels:
        return "no devices listed"
    if len(set(labels)) == 1:
        return f"{len(labels)}× {labels[0]}"
    return ", ".join(labels)


def fmt_time(value: object) -> str:
    """History times: epoch seconds become UTC 'YYYY-MM-DD HH:MM:SSZ'; anything else is shown as given."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 1e8:
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return "—" if value is None or value == "" else str(value)


def as_int(value: object, default: int = 0) -> int:
    """An int field of state.json, `default` for anything else (a bool is not an int here)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def reason_with_cause(entry: Mapping[str, Any]) -> str:
    """A history entry's reason, followed by its root cause's summary when it has one."""
    reason = str(entry.get("reason") or "")
    cause = entry.get("root_cause")
    if isinstance(cause, Mapping) and cause.get("summary"):
        return f"{reason} — root cause: {cause['summary']}" if reason else f"root cause: {cause['summary']}"
    return reason


def first_of(entry: Mapping[str, Any], *keys: str) -> object:
    """The value of the first of `keys` the entry has (not None), else None."""
    for key in keys:
        if entry.get(key) is not None:
            return entry[key]
    return None


def count_text(value: object) -> str:
    """A list's length, or the value as given ('—' for None)."""
    if isinstance(value, list):
        return str(len(value))
    return "—" if value is None else str(value)


def duration_secs(entry: Mapping[str, Any]) -> float | None:
    """A history entry's length in seconds: its own figure, else end minus start; None when unknown."""
    given = entry.get("duration_secs")
    if isinstance(given, int | float) and not isinstance(given, bool):
        return float(given)
    start, end = first_of(entry, "started_at", "opened_at", "start"), first_of(entry, "ended_at", "end")
    if isinstance(start, int | float) and isinstance(end, int | float):
        return float(end) - float(start)
    return None


def exits_summary(value: object) -> str:
    """Rank exit codes of a finished run: 'all 0' or the non-zero ones."""
    pairs: list[tuple[object, int]] = []
    if isinstance(value, Mapping):
        pairs = [(k, as_int(v)) for k, v in value.items()]
    elif isinstance(value, list):
        pairs = [(x.get("rank"), as_int(x.get("code"))) for x in value if isinstance(x, Mapping)]
    if not pairs:
        return "—"
    bad = [f"rank {r}: {c}" for r, c in pairs if c != 0]
    return f"all {len(pairs)} exited 0" if not bad else "; ".join(bad[:8]) + (" …" if len(bad) > 8 else "")


def formed_after(entry: Mapping[str, Any]) -> str:
    """How long the run's window took to form the world: '+12.5s', '+2m 05s', or 'never'."""
    start, formed = entry.get("started_at"), entry.get("formed_at")
    if formed is None and "formed_at" in entry:
        return "never"
    if isinstance(start, int | float) and isinstance(formed, int | float):
        return "+" + fmt_duration(float(formed) - float(start))
    return "—"


def hosts_summary(value: object, limit: int = 6, total: object = None) -> str:
    """A finished run's hosts: 'node-a, node-b', or the first `limit` and how many more. `total`: the run's
    host count when the record lists only some of its hosts (a history record keeps the first 500).
    """
    if not isinstance(value, list):
        return count_text(value)
    names = [str(v) for v in value]
    count = max(as_int(total), len(names))
    if not count:
        return "—"
    shown = names[:limit]
    return ", ".join(shown) + (f" +{count - len(shown)} more" if count > len(shown) else "")
