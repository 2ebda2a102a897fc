"""How the ranks of a formed world were lost (pure, as the window is; `JoinWindow` keeps one): each lost
rank's first cause and the averaging round it was lost in (state.json `losses`), why each host was lost,
and the sentences the run's verdict names them with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from flodld.membership.growth import RankJoin

NAMED_LOSSES = 5
"""Lost ranks a degraded verdict names one by one (state.json `losses` lists every one)."""


@dataclass(frozen=True)
class RankLoss:
    """One lost rank (state.json `losses`): who, where, why, and the averaging round in progress (None when
    the run does not average through the relays, or none had started).
    """

    rank: int
    host: str
    cause: str
    at_secs: float  # since the window opened
    round: int | None = None

    def state(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "cause": self.cause, "round": self.round,
                "at_secs": round(self.at_secs, 3)}  # fmt: skip

    def sentence(self) -> str:
        where = f" in round {self.round}" if self.round is not None else ""
        return f"rank {self.rank} on {self.host!r} {self.cause}{where}"


def describe_exit(code: int) -> str:
    """'code 3' or 'signal 9' (negative codes are signals, as subprocess reports them)."""
    return f"signal {-code}" if code < 0 else f"code {code}"


class LossBook:
    def __init__(self) -> None:
        # rank -> how it was lost (first cause only): state.json `losses`, and the degraded verdict's names.
        self.losses: dict[int, RankLoss] = {}
        # host -> why it was declared lost, the first cause only: the one place loss reasons live. A cause
        # given to `JoinWindow.host_closed(why=...)` is named in the tolerance verdict; a lost join link
        # (`link_ended`) in `final_reason`, after whatever verdict the run got.
        self.host_reasons: dict[str, str] = {}
        self._link_losses: set[str] = set()
        self._rounds: dict[int, int] = {}  # rank -> the round its relay saw it leave in

    def record(self, rank: int, host: str, cause: str, at_secs: float, in_round: int | None) -> bool:
        """Note how `rank` was lost, unless it was already (the first cause stays); True if it was new."""
        if rank in self.losses:
            return False
        in_round = self._rounds.get(rank, in_round)
        self.losses[rank] = RankLoss(rank, host, cause, at_secs, in_round)
        return True

    def correct_round(self, rank: int, in_round: int) -> bool:
        """The round `rank` was lost in, as its relay saw it: replaces the estimate a loss was recorded with
        (its exit report can arrive first), and is kept for a loss recorded later. True if a loss changed.
        """
        self._rounds[rank] = in_round
        loss = self.losses.get(rank)
        if loss is None or loss.round == in_round:
            return False
        self.losses[rank] = replace(loss, round=in_round)
        return True

    def host_lost(self, host: str, why: str, *, link: bool) -> None:
        """`host` was lost because `why` (the first cause stays); `link`: it lost its join link (named in
        `final_reason`, not in the tolerance verdict).
        """
        if host in self.host_reasons:
            return
        self.host_reasons[host] = why
        if link:
            self._link_losses.add(host)

    def final_reason(self, reason: str, *, failed: bool) -> str:
        """The run's verdict sentence `reason`, and after a failure the hosts whose join link was lost."""
        lost = [(host, why) for host, why in self.host_reasons.items() if host in self._link_losses]
        if not failed or not lost:
            return reason
        links = "; ".join(f"host {host!r}: {why}" for host, why in lost)
        return f"{reason} — lost join link(s): " + links

    def host_causes(self) -> str:
        """The hosts lost other than by their join link, for the tolerance verdict: '; host 'a' lost: ...'."""
        return "".join(
            f"; host {host!r} lost: {why}"
            for host, why in self.host_reasons.items()
            if host not in self._link_losses
        )

    def degraded(self, failed: list[int], healed: list[int], joins: Mapping[int, RankJoin]) -> str:
        """What a run that finished short of ranks lost (the first `NAMED_LOSSES` named) and healed in."""
        known = [self.losses[rank].sentence() for rank in failed[:NAMED_LOSSES] if rank in self.losses]
        extra = len(failed) - NAMED_LOSSES
        more = f"; and {extra} more (state.json losses)" if extra > 0 else ""
        named = "; ".join(known) + more
        degraded = f"ranks {failed} lost{': ' + named if named else ''}" if failed else ""
        if failed and healed:
            named_joins = [joins[rank] for rank in healed[:NAMED_LOSSES]]
            extra = len(healed) - NAMED_LOSSES
            named = "; ".join(f"rank {j.rank} on {j.host!r} in round {j.round}" for j in named_joins)
            more = f"; and {extra} more (state.json joins)" if extra > 0 else ""
            degraded += f"; ranks {healed} healed in: {named}{more}"
        return degraded
