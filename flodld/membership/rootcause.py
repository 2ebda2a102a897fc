"""Which rank failure is the run's root cause: the first observed failure, across hosts (sans-io).

torchrun prints a "Root Cause (first observed failure)" for the ranks of one host; the controller
sees the exits of every host, reported by their agents in whatever order the links deliver them. The
rules (docs/operations.md, "When a run fails"):

1. An exit caused by our own teardown is a *consequence*, never a root cause: the agent marks a rank
   `torn_down` when it failed after its host's teardown began (the agent TERMed/KILLed it because a
   sibling rank failed, the controller sent Abort, the link to the controller was lost, or the agent was
   interrupted). A clean exit (code 0) is no failure at all.
2. Among the real failures the one that *failed first* wins, by the agent's wall clock (`failed_at`):
   when the rank raised (its `@record` error file was written, or its traceback began to print) if it
   left such a sign, else when its process ended; the controller's receipt time stands in for an agent
   that gave none. Exit times alone mislead: torch closes a process group's connections while the
   culprit's interpreter shuts down, so a peer that fails on the closed connection can exit first, and
   the culprit's own agent may then TERM it mid-shutdown. A victim raises after the culprit did: on one
   host by construction, across hosts as long as the hosts' clocks agree to better than the time the
   victim took to notice (NTP keeps them within milliseconds; a victim notices in the collective's round
   trip or its timeout). The same time decides `torn_down` on the agent: a rank that raised before its
   host's teardown began is no victim of it, even if the teardown's TERM ended its process.
3. Exact ties (same timestamp) go to the failure whose rank left an error file (`@record`'s exception),
   then to the report that arrived first. There is no "close enough" window that prefers an error file
   over an earlier exit: the timestamps decide, so the rule stays predictable, and a culprit whose
   exception was not recorded (no `@record`) is still named first.

`RootCauseTracker` keeps only the current winner (O(1) memory however many ranks fail).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class Failure:
    """One rank exit as the controller heard it (`code` non-zero)."""

    host: str
    rank: int
    code: int
    failed_at: float  # unix seconds, agent's clock: it raised (error file, traceback), else it exited
    torn_down: bool = False  # the exit followed its host's teardown: a consequence
    error: str | None = None  # the exception `@record` wrote to the rank's error file
    tail: str | None = None  # the rank's last output lines (bounded, secrets scrubbed by the agent)
    order: int = 0  # arrival order at the controller (tie-break)


def is_root_candidate(failure: Failure) -> bool:
    """A failure that may be the root cause: non-zero and not a consequence of our teardown."""
    return failure.code != 0 and not failure.torn_down


def sort_key(failure: Failure) -> tuple[float, int, int]:
    """Earliest failure first; then one with an error file; then the first to arrive."""
    return (failure.failed_at, 0 if failure.error else 1, failure.order)


def first_failure(failures: list[Failure]) -> Failure | None:
    """The root cause among `failures` (None when every one is clean or a consequence)."""
    candidates = [failure for failure in failures if is_root_candidate(failure)]
    return min(candidates, key=sort_key) if candidates else None


def describe_exit(code: int) -> str:
    """'exit code 3' or 'signal 15' (negative codes are signals, as subprocess reports them)."""
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def headline(failure: Failure) -> str:
    """One line: 'rank 1 on host 'a' (exit code 1): RuntimeError: boom'."""
    what = f"rank {failure.rank} on host {failure.host!r} ({describe_exit(failure.code)})"
    if failure.error:
        first = failure.error.strip().splitlines()[0] if failure.error.strip() else ""
        return f"{what}: {first}" if first else what
    return what


class RootCauseTracker:
    """Every rank exit of a run fed in arrival order; `current` is the root cause so far."""

    def __init__(self) -> None:
        self.current: Failure | None = None
        self.failed = 0  # non-zero exits seen
        self.consequences = 0  # of those, exits that followed our own teardown
        self._arrivals = 0

    def observe(self, failure: Failure) -> bool:
        """Record one exit (its `order` is assigned here); True when it became the root cause."""
        self._arrivals += 1
        if failure.code == 0:
            return False
        self.failed += 1
        if failure.torn_down:
            self.consequences += 1
            return False
        failure = Failure(**{**failure.__dict__, "order": self._arrivals})
        if self.current is None or sort_key(failure) < sort_key(self.current):
            self.current = failure
            return True
        return False

    def state(self) -> dict[str, Any] | None:
        """state.json's `root_cause` (see `flodld.membership.snapshot.RootCause`)."""
        failure = self.current
        if failure is None:
            return None
        return {
            "host": failure.host,
            "rank": failure.rank,
            "code": failure.code,
            "exit": describe_exit(failure.code),
            "failed_at": failure.failed_at,
            "error": failure.error,
            "tail": failure.tail.splitlines() if failure.tail else [],
            "summary": headline(failure),
            "failed_ranks": self.failed,
            "consequences": self.consequences,
        }


def root_cause_lines(state: Mapping[str, Any], *, tail_lines: int = 40) -> list[str]:
    """state.json's `root_cause` (or a history entry's) as lines for a terminal: what `fdl run` prints after
    a failed verdict and `fdl status` under the phase. Tolerates missing fields (an older controller).
    """
    summary = state.get("summary") or (
        f"rank {state.get('rank')} on host {state.get('host')!r} ({state.get('exit') or state.get('code')})"
    )
    lines = ["Root cause (first observed failure):", f"  {summary}"]
    at = state.get("failed_at")
    if isinstance(at, int | float) and not isinstance(at, bool) and 0 < at < 10**11:
        when = datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        lines.append(f"  failed at {when} UTC (the agent's clock)")
    error = state.get("error")
    if isinstance(error, str) and error:
        lines.append(f"  error: {error}")
    tail = [str(line) for line in state.get("tail") or []][-tail_lines:]
    if tail:
        lines.append(f"  last {len(tail)} line(s) of its output:")
        lines += [f"  | {line}" for line in tail]
    failed, consequences = state.get("failed_ranks"), state.get("consequences")
    if isinstance(failed, int) and failed > 1:
        torn = f", {consequences} of them torn down by the teardown" if isinstance(consequences, int) else ""
        lines.append(f"  ({failed - 1} other failed rank exit(s) reported{torn})")
    return lines
