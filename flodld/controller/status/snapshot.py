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

A build may list its members as a `MemberRows` (the Controller's do) instead of one page: then the cache
keeps one build for every page. The build's fields are encoded once, around the member list; each row is
encoded once (from the member list as it stood at the build) when a page first needs it; and a page's
bytes are the encoded fields with a slice of the encoded rows spliced in, byte for byte what encoding the
page's own dict gives. A reader asking for a different `?members=A..B` each time then costs a join of
row bytes, not a build and an encoding. Work the cache does for a reader (a build, an encoding, a page
assembled, a status page rendered) is charged to `RenderBudget`, the loop time unauthenticated readers may
spend per second, per source address and in all; past it the reader gets `RenderRefused` (answered 429 with
Retry-After). Answers already in the cache cost nothing and are never refused.

`StormLog` keeps a per-event line (a join, a refusal) for the first `burst` events of each kind per
`period`, then counts them and writes one summary line per kind and period: a storm of 10,000 hellos
writes a few dozen lines, not 10,000, and a flood of bad hellos cannot become a log-volume attack.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
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


RENDER_RATE_SECS: Final = 0.25
"""Loop seconds per second that cache misses (builds, encodings, pages, status renders) may take in all."""
RENDER_BURST_SECS: Final = 1.0
SOURCE_RENDER_RATE_SECS: Final = 0.1
"""The same, for one source address."""
SOURCE_RENDER_BURST_SECS: Final = 0.5
MIN_RENDER_CHARGE_SECS: Final = 50e-6
"""The least a miss is charged (its own bookkeeping, whatever the clock says)."""
MAX_RENDER_SOURCES: Final = 4096
_ENCODE: Final = json.JSONEncoder(separators=(",", ":")).encode


class RenderRefused(Exception):
    """A reader's request would make the cache work past the render budget; ask again after `retry_after`."""

    def __init__(self, detail: str, retry_after: int) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float) -> None:
        self.level = level
        self.stamp = stamp

    def refill(self, now: float, rate: float, burst: float) -> float:
        self.level = min(burst, self.level + (now - self.stamp) * rate)
        self.stamp = now
        return self.level


class RenderBudget:
    """Token buckets of loop time (seconds) for the work readers make the state cache do.

    `admit(source)` before a miss refuses (`RenderRefused`, with the seconds until the emptier bucket is
    positive again) once the source's bucket or the global one is spent; `spend(source, seconds)` charges
    what the miss cost (at least `MIN_RENDER_CHARGE_SECS`). The global bucket bounds what all readers
    together can take of the loop (`rate` seconds per second, after a `burst`); the per-source one keeps
    one address from taking all of it. Sources beyond `max_sources` evict the longest-unseen one (a flood
    of addresses meets the global bucket). `refused` counts refusals; `on_refused` is told of each.
    """

    def __init__(
        self,
        *,
        rate: float = RENDER_RATE_SECS,
        burst: float = RENDER_BURST_SECS,
        source_rate: float = SOURCE_RENDER_RATE_SECS,
        source_burst: float = SOURCE_RENDER_BURST_SECS,
        clock: Callable[[], float] = time.monotonic,
        max_sources: int = MAX_RENDER_SOURCES,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        if min(rate, burst, source_rate, source_burst) <= 0:
            raise ValueError("render budget rates and bursts are > 0 seconds")
        self.rate, self.burst = rate, burst
        self.source_rate, self.source_burst = source_rate, source_burst
        self._clock = clock
        self._max_sources = max_sources
        self._on_refused = on_refused
        self._global = _Bucket(burst, clock())
        self._sources: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0

    def _source(self, source: str, now: float) -> _Bucket:
        bucket = self._sources.get(source)
        if bucket is None:
            bucket = self._sources[source] = _Bucket(self.source_burst, now)
            if len(self._sources) > self._max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        return bucket

    def admit(self, source: str) -> None:
        now = self._clock()
        mine = self._source(source, now).refill(now, self.source_rate, self.source_burst)
        every = self._global.refill(now, self.rate, self.burst)
        if mine > 0 and every > 0:
            return
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused()
        if mine <= 0:
            wait = -mine / self.source_rate
            detail = (
                f"this address spent its render budget ({self.source_rate:g} s of controller time per "
                f"second); cached answers stay free"
            )
        else:
            wait = -every / self.rate
            detail = (
                f"the controller's render budget for unauthenticated readers ({self.rate:g} s per second) "
                "is spent; cached answers stay free"
            )
        raise RenderRefused(detail, max(1, math.ceil(wait)))

    def spend(self, source: str, seconds: float) -> None:
        charge = max(seconds, MIN_RENDER_CHARGE_SECS)
        now = self._clock()
        self._source(source, now).refill(now, self.source_rate, self.source_burst)
        self._sources[source].level -= charge
        self._global.refill(now, self.rate, self.burst)
        self._global.level -= charge


class MemberRows:
    """A build's member list as state.json rows: `encode(begin, end)` gives rows `begin` to `end` as JSON,
    from the members as they stood at the build. Rows are encoded on first use, each once, and shared by
    every page cut from the build (and by a cache built on it). Put one in a build's `members` (followed by
    `members_page`, which the page fills in); `total` is how many members there are.
    """

    def __init__(self, total: int, encode: Callable[[int, int], list[bytes]]) -> None:
        self.total = total
        self._encode = encode
        self._rows: list[bytes] = []

    @property
    def encoded(self) -> int:
        """Rows encoded so far (a prefix of the list)."""
        return len(self._rows)

    def page(self, members: MemberRange) -> tuple[int, int, bytes]:
        """(start, stop, the rows joined by commas) for `members`, clamped as `JoinWindow.state` clamps."""
        total = self.total
        start, stop = min(members[0], total), min(max(members[1], members[0]), total)
        if stop > len(self._rows):
            self._rows += self._encode(len(self._rows), stop)
        return start, stop, b",".join(self._rows[start:stop])


def _frame(data: dict[str, Any]) -> tuple[bytes, bytes]:
    """A paged build's encoding around its member page: the bytes before the `members` list (ending in
    `"members":`) and after the `members_page` object (through the closing brace). Each field is encoded
    as `json.dumps(data, separators=(",", ":"))` encodes it inside the whole.
    """
    keys = list(data)
    at = keys.index("members")
    if keys[at + 1 : at + 2] != ["members_page"]:
        raise ValueError("a paged state lists `members_page` right after `members`")
    head = ",".join(f"{_ENCODE(key)}:{_ENCODE(data[key])}" for key in keys[:at])
    tail = ",".join(f"{_ENCODE(key)}:{_ENCODE(data[key])}" for key in keys[at + 2 :])
    before = "{" + head + ("," if head else "") + '"members":'
    return before.encode(), (("," + tail) if tail else "").encode() + b"}"


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
    _frame: tuple[bytes, bytes] | None = field(default=None, repr=False)
    _pages: OrderedDict[MemberRange, bytes] = field(default_factory=OrderedDict, repr=False)
    _page_data: dict[MemberRange, dict[str, Any]] = field(default_factory=dict, repr=False)
    _derived: dict[str, Any] = field(default_factory=dict, repr=False)
    encodes: int = 0
    """Whole encodings of the build's fields (one per build, however many pages are cut from it)."""

    @property
    def paged(self) -> bool:
        """The build lists its members as `MemberRows`: every page is cut from it."""
        return self.data is not None and isinstance(self.data.get("members"), MemberRows)

    @property
    def body(self) -> bytes | None:
        """The build's JSON text (a paged build: its default page)."""
        if self.data is None:
            return None
        if self.paged:
            return self.page(DEFAULT_MEMBERS)
        if self._body is None:
            begun = time.perf_counter()
            self._body = json.dumps(self.data, separators=(",", ":")).encode()
            self.encodes += 1
            self.cost += time.perf_counter() - begun
        return self._body

    def has_page(self, members: MemberRange) -> bool:
        """The page's bytes are ready (asking for them costs nothing)."""
        return self.data is None or (members in self._pages if self.paged else self._body is not None)

    def page(self, members: MemberRange) -> bytes | None:
        """The page `members` of a paged build as JSON text (the last `MAX_CACHED_PAGES` asked kept)."""
        data = self.data
        if data is None:
            return None
        rows = data.get("members")
        if not isinstance(rows, MemberRows):
            return self.body
        body = self._pages.get(members)
        if body is not None:
            self._pages.move_to_end(members)
            return body
        begun = time.perf_counter()
        if self._frame is None:
            self._frame = _frame(data)
            self.encodes += 1
        before, after = self._frame
        start, stop, joined = rows.page(members)
        body = b"".join(
            (
                before, b"[", joined, b'],"members_page":{"start":%d,"stop":%d,"total":%d}' % (
                    start, stop, rows.total
                ), after,
            )
        )  # fmt: skip
        self._pages[members] = body
        while len(self._pages) > MAX_CACHED_PAGES:
            self._pages.popitem(last=False)
        self.cost += time.perf_counter() - begun
        return body

    def page_data(self, members: MemberRange) -> dict[str, Any] | None:
        """The page `members` as data (a paged build: parsed from its bytes once; shared: do not change)."""
        if not self.paged:
            return self.data
        data = self._page_data.get(members)
        if data is None:
            body = self.page(members)
            assert body is not None
            if len(self._page_data) >= MAX_CACHED_PAGES:
                self._page_data.clear()
            data = self._page_data[members] = json.loads(body)
        return data

    def derived(self, name: str, make: Callable[[CachedState], Any]) -> Any:  # noqa: ANN401  what `make` gives
        """`make(self)`, made once per build (the status page): its cost counts as the build's."""
        if name not in self._derived:
            begun = time.perf_counter()
            self._derived[name] = make(self)
            self.cost += time.perf_counter() - begun
        return self._derived[name]


class StateCache:
    """Builds at most once per version change and per `interval`; a few member pages cached side by side
    (a paged build, see `MemberRows`: one build, every page cut from it).
    """

    def __init__(
        self,
        build: Callable[[MemberRange], dict[str, Any] | None],
        version: Callable[[], Hashable],
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = STATE_INTERVAL_SECS,
        max_age: float = STATE_MAX_AGE_SECS,
        depends_on: Callable[[], int] | None = None,
        budget: RenderBudget | None = None,
    ) -> None:
        """`budget`: what `body`, `data` and `derived` may spend for a reader that names its source."""
        self._build = build
        self.budget = budget
        self._depends_on = depends_on
        self.clears = 0
        self._version = version
        self._clock = clock
        self.interval = interval
        self.max_age = max_age
        self._entries: dict[MemberRange, CachedState] = {}
        self._paged: CachedState | None = None  # the build every page is cut from (a paged source)
        self.builds = 0

    def _fresh(self, members: MemberRange) -> CachedState | None:
        """The build a reader of `members` gets now without building, if there is one."""
        entry = self._entries.get(members)
        if entry is None:
            entry = self._paged
            if entry is None or not entry.paged:
                return None
        epoch = self._depends_on() if self._depends_on is not None else 0
        if entry.epoch != epoch:
            return None
        age = self._clock() - entry.built_at
        hold = max(self.interval, entry.cost * COST_FACTOR)
        if age < hold or (age < max(self.max_age, hold) and entry.version == self._version()):
            return entry
        return None

    def get(self, members: MemberRange = DEFAULT_MEMBERS) -> CachedState:
        """The build serving `members`: cached while fresh, else built now (for a paged build, whatever the
        page: every page is cut from it).
        """
        entry = self._fresh(members)
        if entry is not None:
            return entry
        now = self._clock()
        epoch = self._depends_on() if self._depends_on is not None else 0
        version = self._version()
        begun = time.perf_counter()
        data = self._build(members)
        entry = CachedState(version, epoch, now, data, cost=time.perf_counter() - begun)
        self.builds += 1
        if entry.paged:
            self._entries.clear()
            self._paged = entry
            return entry
        self._paged = None
        self._entries.pop(members, None)
        self._entries[members] = entry
        while len(self._entries) > MAX_CACHED_PAGES:
            self._entries.pop(next(iter(self._entries)))
        return entry

    def _charged(self, source: str | None, ready: bool, work: Callable[[], Any]) -> Any:  # noqa: ANN401
        """`work()`, charged to `source`'s render budget unless `ready` (a cached answer: free)."""
        budget = self.budget
        if ready or source is None or budget is None:
            return work()
        budget.admit(source)
        begun = time.perf_counter()
        try:
            return work()
        finally:
            budget.spend(source, time.perf_counter() - begun)

    def body(self, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None) -> bytes | None:
        """The page `members` as JSON text; with `source`, work past the cache is charged to it
        (`RenderRefused` past the budget).
        """
        entry = self._fresh(members)
        ready = entry is not None and entry.has_page(members)
        return self._charged(source, ready, lambda: self.get(members).page(members))  # type: ignore[no-any-return]

    def data(self, members: MemberRange = DEFAULT_MEMBERS) -> dict[str, Any] | None:
        """The page `members` as data (shared: do not change it)."""
        return self.get(members).page_data(members)

    def head(self) -> dict[str, Any] | None:
        """The current build itself (a paged build: its fields and `MemberRows`; shared, do not change it),
        for a cache built on this one.
        """
        return self.get(DEFAULT_MEMBERS).data

    def derived(self, name: str, make: Callable[[CachedState], Any], source: str | None = None) -> Any:  # noqa: ANN401
        """`make(build)` once per build of the default page (the status page), charged like `body`."""
        entry = self._fresh(DEFAULT_MEMBERS)
        ready = entry is not None and name in entry._derived
        return self._charged(source, ready, lambda: self.get(DEFAULT_MEMBERS).derived(name, make))

    def clear(self) -> None:
        """Forget every build: the next reader gets a fresh one."""
        self._entries.clear()
        self._paged = None
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
