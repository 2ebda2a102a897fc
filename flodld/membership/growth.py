"""Growth during training (docs/elastic-averaging.md, "Growth and healing"): whether a walk-in may enter.

A run with an elastic bound (`controller.join.elastic_max_ranks`) admits hosts that join while it trains,
as long as its live ranks plus the walk-in's stay within the bound. The walk-in's ranks get fresh rank ids
(the next ids after every id the run ever gave out: a lost rank's id is never reused) and enter the
averaging at a round boundary (the data plane's `flodld.fold.entry`). A host of the formed world whose
join link ended (lost, or closed) may walk in again under its name: its earlier ranks stay lost, its new
ones are fresh. Pure: the window asks, the shell acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flodld.membership.ledger import Refused
from flodld.membership.phase import Phase
from flodld.membership.snapshot import LinkState


@dataclass(frozen=True)
class RankJoin:
    """A rank that walked in during training (state.json `joins`): who, where, when, and the averaging
    round it entered (None until its relay reached a round boundary).
    """

    rank: int
    host: str
    at_secs: float  # since the window opened
    round: int | None = None

    def state(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "round": self.round, "at_secs": round(self.at_secs, 3)}


def growth_refusal(
    *,
    host: str,
    phase: Phase,
    bound: int | None,
    live_ranks: int,
    offered: int,
    link: LinkState | None,
) -> Refused | None:
    """Why a hello that arrives after formation is refused, or None when it may walk in.

    `live_ranks`: ranks of the run not lost and not exited; `link`: the host's join link in the formed world
    (None: a new host). The codes are transient for `fdl join --persist` (it dials again).
    """
    if bound is None:
        return Refused(
            "window_closed",
            f"host {host!r}: the join window is closed; wait for the next run (this run does not admit "
            "walk-ins during training: set controller.join.elastic_max_ranks, flodld serve "
            "--elastic-max-ranks, for an elastic CPU-averaging run that grows)",
        )
    if phase is not Phase.TRAINING:
        return Refused(
            "window_closed",
            f"host {host!r}: the run is {phase.value}, not training; walk-ins enter a training run only "
            "(dial again)",
        )
    if link is LinkState.OPEN:
        return Refused(
            "duplicate_host",
            f"host {host!r} is in this run with its join link open (a stale worker, or two workers sharing "
            "one host name); give each worker a distinct --host",
        )
    if live_ranks + offered > bound:
        return Refused(
            "elastic_full",
            f"host {host!r} offers {offered} rank(s) and the run trains {live_ranks} live rank(s) of at most "
            f"{bound} (elastic_max_ranks); it is admitted once ranks are lost (fdl join --persist dials "
            "again), or raise elastic_max_ranks",
        )
    return None
