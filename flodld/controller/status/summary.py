"""The one summariser of state.json: the wording of its headline and of its finished runs (`flodld serve`'s
history), as a pure function of the state.

Every reader that words the state shows these texts, so none of them decides a wording (or a condition,
such as when a manual window is startable) on its own:
- the status page, served rendered (`flodld.controller.status.page`);
- the page's script, which shows them from state.json's `summary` (the controller adds it to each build:
  `summarised`), ticking only the countdowns between polls;
- `fdl status`, which summarises the state it fetched (`flodld.api.summarise`), so it words the state of
  an older controller that sends no `summary` the same way.

Pure: no I/O, no clock (the countdowns are the state's own seconds), the standard library only, so that
`fdl status` can load it without the controller's dependencies (tests/test_layers.py holds it to that).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from flodld.controller.status.wording import (
    as_int,
    count_text,
    duration_secs,
    exits_summary,
    first_of,
    fmt_devices,
    fmt_duration,
    fmt_ranks,
    fmt_secs,
    fmt_time,
    formed_after,
    hosts_summary,
    reason_with_cause,
)

PHASE_NOTES = {
    "waiting": "window open, quorum not met yet",
    "staging": "quorum met, window still open",
    "forming": "the world is being formed",
    "training": "the world formed; ranks are running",
    "done": "every host link closed cleanly",
    "failed": "the run failed",
}
# Staging with the window's clock run out: only a manual start holds a window past expiry.
HELD_NOTE = "quorum met, window expired: held until `fdl start` (or the hard cap)"
AUTO_START = "auto — the window closes by itself once quorum and target (or the window's end) allow"
MAX_HISTORY = 50  # finished runs the page lists and state.json's summary words (fdl status --history: all)
HISTORY_COLUMNS = ("run", "verdict", "ended", "formed", "duration", "ranks", "hosts", "rank exits", "reason")
MEMBER_COLUMNS = ("host", "ranks", "devices", "variant", "joined", "link")


@dataclass(frozen=True)
class Summary:
    """state.json's headline in words (`StatusSummary` in flodld/membership/snapshot.py describes each
    field as state.json's `summary` carries it).
    """

    note: str
    ranks: str
    window: str
    cap: str
    start: str
    start_go: bool
    attempts: tuple[str, ...]
    service: str
    history: tuple[tuple[str, ...], ...] | None
    """`flodld serve`: the newest `MAX_HISTORY` finished runs, a row of `HISTORY_COLUMNS` each; None for a
    single run (state.json has no `history`)."""

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["attempts"] = list(self.attempts)
        data["history"] = None if self.history is None else [list(row) for row in self.history]
        return data


def summarise(state: Mapping[str, Any]) -> Summary:
    """The headline of one state.json dict (any field may be missing or malformed: never raises)."""
    return Summary(
        note=phase_note(state),
        ranks=ranks_text(state),
        window=countdown_text(state.get("window_remaining_secs")),
        cap=countdown_text(state.get("cap_remaining_secs")),
        start=start_text(state),
        start_go=bool(state.get("startable") or state.get("start_armed")),
        attempts=tuple(attempt_texts(state.get("attempt"))),
        service=service_text(state),
        history=None if state.get("history") is None else history_rows(state, MAX_HISTORY),
    )


def summarised(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its `summary` set (over whatever else the build put in it), for the page's script."""
    state["summary"] = summarise(state).as_json()
    return state


def phase_note(state: Mapping[str, Any]) -> str:
    """The phase's gloss; a staging window whose clock has run out is held, not open."""
    phase = str(state.get("phase") or "?")
    if phase == "staging" and not isinstance(state.get("window_remaining_secs"), int | float):
        return HELD_NOTE
    return PHASE_NOTES.get(phase, "")


def ranks_text(state: Mapping[str, Any]) -> str:
    """'3 joined across 2 host(s) — quorum 2, target 4' ('no target' without one)."""
    target = as_int(state.get("target"))
    return (
        f"{as_int(state.get('joined_ranks'))} joined across {as_int(state.get('joined_hosts'))} host(s) — "
        f"quorum {as_int(state.get('quorum'))}, " + (f"target {target}" if target else "no target")
    )


def countdown_text(value: object) -> str:
    """A window clock: '42s left', '3m 05s left', or 'closed' (expired, passed or no window)."""
    counting = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{fmt_secs(value)} left" if counting else "closed"


def start_text(state: Mapping[str, Any]) -> str:
    """What the start switch says: armed, startable (state.json's `startable`, the window's own verdict),
    waiting for quorum, or closed.
    """
    mode = str(state.get("start_mode") or "auto")
    if mode == "auto":
        return AUTO_START
    if state.get("start_armed"):
        what = "armed — forming at the next tick"
    elif state.get("startable"):
        what = "startable — fire with `fdl start`"
    elif state.get("phase") in ("waiting", "staging"):
        joined, quorum = as_int(state.get("joined_ranks")), as_int(state.get("quorum"))
        what = f"waiting for quorum ({joined} of {quorum} ranks)"
    else:
        what = "window closed"
    return f"{mode} — {what}"


def attempt_texts(attempt: object) -> list[str]:
    """state.json's `attempt` as lines: `attempt N of at most M`, then each earlier attempt with its run,
    hosts and cause ([] without one).
    """
    if not isinstance(attempt, Mapping):
        return []
    texts = [f"attempt {attempt.get('number')} of at most {attempt.get('max_attempts')}"]
    for earlier in attempt.get("earlier") or []:
        if isinstance(earlier, Mapping):
            hosts = ", ".join(str(h) for h in earlier.get("hosts") or []) or "-"
            texts.append(
                f"attempt {earlier.get('number')} (run {earlier.get('run_id')}, hosts {hosts}) failed: "
                f"{earlier.get('cause')}"
            )
    return texts


def service_text(state: Mapping[str, Any]) -> str:
    """The daemon around the runs (`flodld serve` without --once), one line; '' for a single run."""
    service = state.get("service")
    if not isinstance(service, Mapping):
        return ""
    given = service.get("runs")
    runs: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    parts = [
        f"service: run {as_int(service.get('runs_started'))}",
        f"{as_int(runs.get('done'))} done, {as_int(runs.get('failed'))} failed",
    ]
    if service.get("between_runs"):
        wait = service.get("next_window_in_secs")
        parts.append(
            "between runs" + (f" — next window in {fmt_secs(wait)}" if isinstance(wait, int | float) else "")
        )
    return " · ".join(parts)


def history_rows(state: Mapping[str, Any], limit: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The finished runs of `flodld serve` (state.json's `history`, newest first, the first `limit`), each a
    row of `HISTORY_COLUMNS`: the page's table and `fdl status --history`.
    """
    given = state.get("history")
    entries = [entry for entry in given if isinstance(entry, Mapping)] if isinstance(given, list) else []
    return tuple(history_row(entry) for entry in entries[:limit])


def history_row(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """One finished run in words (`HISTORY_COLUMNS`): any field may be missing or malformed."""
    duration = duration_secs(entry)
    return (
        str(entry.get("run_id") or "?"),
        str(first_of(entry, "verdict", "phase") or "?"),
        fmt_time(first_of(entry, "ended_at", "end")),
        formed_after(entry),
        fmt_duration(duration) if duration is not None else "—",
        count_text(entry.get("ranks")),
        hosts_summary(entry.get("hosts"), total=entry.get("host_count")),
        exits_summary(entry.get("rank_exits")),
        history_reason(entry),
    )


def history_reason(entry: Mapping[str, Any]) -> str:
    """A finished run's reason: its attempt (a restarted run), the verdict's sentence with its root cause,
    and each earlier attempt's cause (the history keeps one entry per run, its last attempt).
    """
    attempt = entry.get("attempt")
    if not isinstance(attempt, Mapping):
        return reason_with_cause(entry)
    earlier = [e for e in attempt.get("earlier") or [] if isinstance(e, Mapping)]
    after = "; ".join(f"attempt {e.get('number')} failed: {e.get('cause')}" for e in earlier)
    return (
        f"[attempt {attempt.get('number')}/{attempt.get('max_attempts')}] {reason_with_cause(entry)}"
        + (f" — after {after}" if after else "")
    )


def member_row(member: Mapping[str, Any]) -> tuple[str, ...]:
    """One host of state.json's `members` in words (`MEMBER_COLUMNS`): the page's hosts table and `fdl
    status`'s host lines.

    The page's script words its live rows with its twins of `fmt_ranks` and `fmt_devices`, since state.json
    carries no text per member (a page of 500 hosts would double); tests/browser checks both renderings agree.
    """
    joined = member.get("joined_at_secs")
    ranks = member.get("ranks")
    return (
        str(member.get("host", "?")),
        fmt_ranks(ranks if isinstance(ranks, list) else []),
        fmt_devices(member),
        str(member.get("variant") or "-"),
        f"+{int(joined)}s" if isinstance(joined, int | float) and not isinstance(joined, bool) else "—",
        str(member.get("link") or "open"),
    )
