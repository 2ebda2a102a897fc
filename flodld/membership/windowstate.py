"""The join window's state.json view: the snapshot, a page of members, and member rows made on demand.

Pure, as the window is: it reads a `JoinWindow` (flodld/membership/window.py, whose `state`, `snapshot`,
`member_view` and `member_row` call these) and returns JSON-ready data; O(page + roster + exits), never
O(members), except `member_view`'s reference copies. It knows the window only as `WindowView`, the
face declared here (what it reads, never a change), so this module imports nothing of window.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flodld.membership.ledger import Ledger, Member, World
from flodld.membership.phase import WINDOW_PHASES, Phase
from flodld.membership.policy import MAX_WORLD_RANKS, StartMode, WindowPolicy
from flodld.membership.rootcause import RootCauseTracker
from flodld.membership.snapshot import DEFAULT_MEMBER_PAGE, LinkState, StateSnapshot


class StateRow(Protocol):
    """An entry that renders itself as one JSON-ready row (the window's `RankLoss`)."""

    def state(self) -> dict[str, Any]: ...


class WindowView(Protocol):
    """What state.json reads of a `JoinWindow`: its fields and two queries, never a change."""

    policy: WindowPolicy
    roster: tuple[str, ...]
    opened_at: float
    run_id: str
    controller: str
    ledger: Ledger
    phase: Phase
    reason: str
    start_armed: bool
    world: World | None
    links: dict[str, LinkState]
    rank_exits: dict[int, int]
    root_cause: RootCauseTracker

    @property
    def losses(self) -> Mapping[int, StateRow]: ...  # read-only: the window's rows are its own `RankLoss`
    @property
    def joins(self) -> Mapping[int, StateRow]: ...  # read-only: the window's rows are its own `RankJoin`
    @property
    def link_counts(self) -> Mapping[str, int]: ...

    def elapsed(self, now: float) -> float: ...


@dataclass(frozen=True)
class MemberView:
    """Every member as it stood at one instant (`JoinWindow.member_view`): rows encoded from it later, page by
    page, agree with each other and with the counts built at that instant.
    """

    members: Sequence[Member]
    ranks: Callable[[Member], tuple[int, ...]]
    links: Mapping[str, LinkState]


def snapshot(window: WindowView, now: float, members: tuple[int, int] | None = None) -> StateSnapshot:
    """state.json at `now` as the model (countdowns computed live, never frozen); every member unless
    `members` = (start, stop) asks for a page. The controller serves `state` (no model per member).
    """
    return StateSnapshot.model_validate(state(window, now, members or (0, MAX_WORLD_RANKS)))


def state(
    window: WindowView, now: float, members: tuple[int, int] = (0, DEFAULT_MEMBER_PAGE)
) -> dict[str, Any]:
    """state.json at `now` as JSON-ready data: the page `members` = (start, stop) of hosts in admission
    order, and every member counted. O(page + roster + exits), never O(members).
    """
    elapsed = window.elapsed(now)
    window_open = window.phase in WINDOW_PHASES
    ledger, links = window.ledger, window.links
    joined = ledger.joined_ranks
    total = ledger.member_count
    start, stop = min(members[0], total), min(max(members[1], members[0]), total)
    if window.world is not None:
        page: list[Member] = list(window.world.members[start:stop])
        ranks_of = window.world.ranks.__getitem__
    else:
        page = ledger.members_slice(start, stop)
        ranks_of = ledger.ranks_of
    missing = [host for host in window.roster if ledger.member(host) is None] if window.roster else []
    by_link = (
        dict(window.link_counts)
        if window.world is not None
        else ({LinkState.OPEN.value: total} if total else {})
    )
    return {
        "phase": window.phase.value,
        "reason": window.reason,
        "run_id": window.run_id,
        "controller": window.controller,
        "joined_ranks": joined,
        "joined_hosts": total,
        "quorum": window.policy.quorum,
        "target": window.policy.target,
        "window_remaining_secs": _remaining(window.policy.window_secs, elapsed) if window_open else None,
        "cap_remaining_secs": _remaining(window.policy.cap_secs, elapsed) if window_open else None,
        "start_mode": window.policy.start.value,
        "start_armed": window.start_armed,
        "startable": window_open
        and window.policy.start is not StartMode.AUTO
        and joined >= window.policy.quorum,
        "members": [member_row(window, m, ranks_of(m.host), links.get(m.host, LinkState.OPEN)) for m in page],
        "members_page": {"start": start, "stop": stop, "total": total},
        "member_counts": {
            "by_link": dict(sorted(by_link.items())),
            "by_variant": dict(sorted(ledger.variant_counts.items())),
            "by_vendor": dict(sorted(ledger.vendor_counts.items())),
        },
        "missing": missing,
        "refused": dict(sorted(ledger.refused_counts.items())),
        "rank_exits": [{"rank": r, "code": c} for r, c in sorted(window.rank_exits.items())],
        "root_cause": window.root_cause.state(),
        "losses": [loss.state() for _, loss in sorted(window.losses.items())],
        "joins": [join.state() for _, join in sorted(window.joins.items())],
    }


def member_view(window: WindowView) -> MemberView:
    """The members, their ranks and link states as they stand now, for rows made later (`member_row`).

    O(members) references copied at C speed (the member tuple, the first-rank and link maps), never a
    row: the controller encodes rows from it on demand, once per row content.
    """
    if window.world is not None:
        return MemberView(window.world.members, _ranks_in(window.world.ranks), dict(window.links))
    return MemberView(window.ledger.members, _ranks_from(window.ledger.first_ranks()), dict(window.links))


def member_row(window: WindowView, m: Member, ranks: Sequence[int], link: LinkState) -> dict[str, Any]:
    """One `members` entry of state.json (what `state` lists for `m`)."""
    return {
        "host": m.host,
        "ranks": list(ranks),
        "devices": list(m.devices),
        "device_labels": list(m.device_labels),
        "variant": m.variant,
        "joined_at_secs": round(m.joined_at - window.opened_at, 3),
        "link": link.value,
    }


def _remaining(limit: float, elapsed: float) -> float | None:
    """Seconds left before `limit`; 0 exactly at the limit, None after it."""
    return None if elapsed > limit else round(limit - elapsed, 3)


def _ranks_in(ranks: Mapping[str, tuple[int, ...]]) -> Callable[[Member], tuple[int, ...]]:
    """A formed world's ranks (frozen with it) by member."""
    return lambda m: ranks[m.host]


def _ranks_from(first: Mapping[str, int]) -> Callable[[Member], tuple[int, ...]]:
    """Ranks by member from a copy of the ledger's first ranks (`Ledger.ranks_of`, as of the copy)."""
    return lambda m: tuple(range(first[m.host], first[m.host] + len(m.devices)))
