"""state.json at scale: one build per state change and per interval, serialized once for every reader;
and log lines coalesced during a join storm.

`StateCache` sits between the HTTP app and whoever builds the state (the Controller, the Service). A
build is reused while it is younger than `interval` (200 ms: the most a burst of pollers can cost is one
build per interval), and for up to `max_age` (1 s: countdowns and connection counts move on their own)
while the state's version (`JoinWindow.generation` and friends) has not moved. An expensive build (a
`?members=all` of 10,000 hosts takes ~100 ms) is held for `COST_FACTOR` times what it cost to build and
encode, so whatever readers ask, state.json takes at most ~1/COST_FACTOR of the event loop. Discrete changes
that a reader should see at once (a phase change, a run ending, a reload) `clear()` the cache instead; a cache
built on another's (the Service's on its run's) passes `depends_on` so that one's clears reach it too. The
JSON text is encoded once per build, on first use, and handed to every reader as the same bytes. A reader
must not change the data it gets: it is shared.

`StormLog` keeps a per-event line (a join, a refusal) for the first `burst` events of each kind per
`period`, then counts them and writes one summary line per kind and period: a storm of 10,000 hellos
writes a few dozen lines, not 10,000, and a flood of bad hellos cannot become a log-volume attack.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Final

from flodld.membership.policy import MAX_WORLD_RANKS
from flodld.membership.snapshot import DEFAULT_MEMBER_PAGE

MemberRange = tuple[int, int]
"""Members `start` (inclusive) to `stop` (exclusive), in admission order."""

DEFAULT_MEMBERS: Final[MemberRange] = (0, DEFAULT_MEMBER_PAGE)
ALL_MEMBERS: Final[MemberRange] = (0, MAX_WORLD_RANKS)
STATE_INTERVAL_SECS: Final = 0.2
STATE_MAX_AGE_SECS: Final = 1.0
MAX_CACHED_PAGES: Final = 8
COST_FACTOR: Final = 10.0


class BadMembersQuery(ValueError):
    """`?members=` is neither `A..B` (inclusive indexes, A <= B) nor `all`."""


def parse_members(text: str | None) -> MemberRange:
    """`?members=` as a range.

    Absent -> the default page, `all` -> every member, `A..B` -> A to B inclusive.
    """
    if text is None or text == "":
        return DEFAULT_MEMBERS
    if text == "all":
        return ALL_MEMBERS
    first, sep, last = text.partition("..")
    if not sep or not (first.isdigit() and last.isdigit()) or len(first) > 10 or len(last) > 10:
        raise BadMembersQuery(f"members={text[:40]!r}: expected A..B (inclusive indexes, e.g. 0..499) or all")
    start, stop = int(first), int(last) + 1
    if start >= stop or stop > MAX_WORLD_RANKS:
        raise BadMembersQuery(f"members={text[:40]!r}: expected A <= B < {MAX_WORLD_RANKS}")
    return start, stop


@dataclass
class CachedState:
    """One build: the data (shared, read-only) and its JSON text, encoded once on first use."""

    version: Hashable
    epoch: int
    built_at: float
    data: dict[str, Any] | None
    cost: float = 0.0
    """Seconds spent building (and, once encoded, encoding) it."""
    _body: bytes | None = field(default=None, repr=False)

    @property
    def body(self) -> bytes | None:
        if self.data is None:
            return None
        if self._body is None:
            begun = time.perf_counter()
            self._body = json.dumps(self.data, separators=(",", ":")).encode()
            self.cost += time.perf_counter() - begun
        return self._body


class StateCache:
    """Builds at most once per version change and per `interval`; a few member pages cached side by side."""

    def __init__(
        self,
        build: Callable[[MemberRange], dict[str, Any] | None],
        version: Callable[[], Hashable],
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = STATE_INTERVAL_SECS,
        max_age: float = STATE_MAX_AGE_SECS,
        depends_on: Callable[[], int] | None = None,
    ) -> None:
        self._build = build
        self._depends_on = depends_on
        self.clears = 0
        self._version = version
        self._clock = clock
        self.interval = interval
        self.max_age = max_age
        self._entries: dict[MemberRange, CachedState] = {}
        self.builds = 0

    def get(self, members: MemberRange = DEFAULT_MEMBERS) -> CachedState:
        now = self._clock()
        epoch = self._depends_on() if self._depends_on is not None else 0
        entry = self._entries.get(members)
        if entry is not None and entry.epoch == epoch:
            age = now - entry.built_at
            hold = max(self.interval, entry.cost * COST_FACTOR)
            if age < hold or (age < max(self.max_age, hold) and entry.version == self._version()):
                return entry
        version = self._version()
        begun = time.perf_counter()
        data = self._build(members)
        entry = CachedState(version, epoch, now, data, cost=time.perf_counter() - begun)
        self.builds += 1
        self._entries.pop(members, None)
        self._entries[members] = entry
        while len(self._entries) > MAX_CACHED_PAGES:
            self._entries.pop(next(iter(self._entries)))
        return entry

    def clear(self) -> None:
        """Forget every build: the next reader gets a fresh one."""
        self._entries.clear()
        self.clears += 1


class StormLog:
    """Per-event log lines up to `burst` per kind and `period`; past that, one summary line per period."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 20,
        period: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.period = period
        self._clock = clock
        self._period_start = clock()
        self._counts: dict[str, int] = {}
        # kind -> (events held, highest level, the last held event's detail, formatted only if written)
        self._held: dict[str, tuple[int, int, Callable[[], str]]] = {}

    def event(
        self, kind: str, level: int, message: str, *args: object, detail: Callable[[], str] | None = None
    ) -> None:
        """Log `message % args` unless this kind is past its burst this period; then hold (count) it."""
        self._roll()
        count = self._counts.get(kind, 0) + 1
        self._counts[kind] = count
        if count <= self.burst:
            self.logger.log(level, message, *args, stacklevel=2)
            return
        held, top, _ = self._held.get(kind, (0, level, _nothing))
        self._held[kind] = (held + 1, max(level, top), detail or _nothing)

    def flush(self) -> None:
        """Write the summary lines for the events held so far (call at the end of a storm, e.g. formation)."""
        for kind, (count, level, detail) in self._held.items():
            last = detail()
            self.logger.log(
                level,
                "event=%s_coalesced count=%d period_secs=%g%s",
                kind,
                count,
                self.period,
                f" last: {last}" if last else "",
            )
        self._held.clear()

    def _roll(self) -> None:
        now = self._clock()
        if now - self._period_start >= self.period:
            self.flush()
            self._counts.clear()
            self._period_start = now

    def tick(self) -> None:
        """Let a quiet period end (the summary of the last burst is written without waiting for an event)."""
        self._roll()


def _nothing() -> str:
    return ""
