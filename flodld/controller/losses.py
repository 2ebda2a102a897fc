"""The run's losses: rank exits, ranks declared dead, join links that end, and their tolerance.

The window (flodld/membership/window.py) decides what each means; this logs it, tells a host to kill a rank
the relays fold out (KillRank), names the averaging round each loss was in (the data plane's estimate where
the rank cannot say) and has the Controller act on the phase.
"""

from __future__ import annotations

import logging
import time

from flodld.controller.join import CHANNEL as JOIN_CHANNEL
from flodld.controller.join import HostLink
from flodld.controller.runparts import LossRun
from flodld.membership.phase import TERMINAL_PHASES
from flodld.membership.rootcause import Failure
from flodld.membership.window import JoinWindow, LinkOutcome
from flodld.wire.errors import WireError
from flodld.wire.join import KillRank, RankExited

log = logging.getLogger("flodld.controller")


class RankLosses:
    """`run`'s loss and tolerance bookkeeping (the Controller hands the join channel's and the data plane's
    calls on to it).
    """

    def __init__(self, run: LossRun) -> None:
        self.run = run

    def rank_exited(self, link: HostLink, rank: int, code: int, report: RankExited | None = None) -> None:
        window = self.run.window
        if window is None or window.world is None or rank not in window.world.ranks.get(link.host, ()):
            log.warning(
                "event=rank_exit_ignored host=%s rank=%d code=%d reason=not this host's rank in a formed "
                "world",
                link.host,
                rank,
                code,
            )
            return
        if code:
            log.warning("event=rank_exited host=%s rank=%d code=%d", link.host, rank, code)
        else:  # clean exits of a large world arrive as a storm: coalesced past a burst
            self.run.storm_log.event(
                "rank_exited",
                logging.INFO,
                "event=rank_exited host=%s rank=%d code=%d",
                link.host,
                rank,
                code,
                detail=lambda: f"host={link.host} rank={rank}",
            )
        decided = window.phase in TERMINAL_PHASES
        failure = None
        if code:
            # The agent's clock at the exit orders failures across hosts; an older agent's report is
            # stamped at receipt.
            at = report.failed_at if report is not None and report.failed_at is not None else time.time()
            failure = Failure(
                host=link.host,
                rank=rank,
                code=code,
                failed_at=at,
                torn_down=report.torn_down if report is not None else False,
                error=report.error if report is not None else None,
                tail=report.tail if report is not None else None,
            )
        # After the verdict: recorded for state.json (and the root cause) only.
        in_round = self.run.round_in_progress(rank)
        window.rank_exited(rank, code, self.run.clock(), failure=failure, in_round=in_round)
        if not decided:
            self.run.settle()

    def rank_round(self, rank: int, in_round: int) -> None:
        """The data plane learned the round `rank` left in from its relay: a loss recorded with an estimate
        is corrected (state.json `losses`, the degraded verdict).
        """
        window = self.run.window
        if window is not None:
            window.correct_loss_round(rank, in_round)

    @property
    def survives_rank_loss(self) -> bool:
        """The run averages through the relays and tolerates losses: a rank can be lost without its host
        (the relays fold it out of the rounds; docs/elastic-averaging.md).
        """
        return self.run.options.cpu_averaging and self.tolerance > 0

    @property
    def tolerance(self) -> int:
        """Rank failures the run survives: the configured count, or once the world formed, its share of it."""
        window = self.run.window
        if window is not None and window.world is not None:
            return window.tolerance
        return self.run.options.tolerance

    def rank_lost(self, rank: int, why: str) -> None:
        """A subsystem (the data plane's liveness) declared `rank` dead. In a run that survives a rank's loss
        only the rank is lost: it counts as failed, and its agent is told to dump its stack and kill it
        (KillRank). Otherwise its host counts as lost, so its unreported ranks fail the run beyond the
        tolerance, and the reason names the host.
        """
        window = self.run.window
        if window is None or window.world is None or window.phase in TERMINAL_PHASES:
            return
        host = next((h for h, ranks in window.world.ranks.items() if rank in ranks), None)
        if host is None:
            log.warning("event=rank_lost_ignored rank=%d reason=not in the formed world", rank)
            return
        if rank in window.rank_exits:
            return  # it already reported its exit; the silence is the exit
        log.warning("event=rank_lost host=%s rank=%d why=%r", host, rank, why)
        if self.survives_rank_loss:
            in_round = self.run.round_in_progress(rank)
            window.rank_declared_dead(rank, self.run.clock(), why=why, in_round=in_round)
            link = self.run.links.get(host)
            if link is not None and not link.closed.is_set() and window.phase not in TERMINAL_PHASES:
                try:
                    link.stream.send_nowait(KillRank(rank=rank, reason=why[:1024]))
                    self.run.counters.frame_out(JOIN_CHANNEL, 0)
                except (OSError, WireError) as error:
                    log.warning("event=kill_rank_unsent host=%s rank=%d error=%r", host, rank, str(error))
        else:
            self._estimate_loss_rounds(window, host)
            window.host_closed(host, self.run.clock(), lost=True, why=why)
        self.run.settle()

    def _estimate_loss_rounds(self, window: JoinWindow, host: str) -> None:
        """Before a host may be lost: the round each of its unreported ranks was in, as the data plane
        estimates it (its relay, gone with it, cannot say), for the losses the window then records.
        """
        world = window.world
        if world is None or window.phase in TERMINAL_PHASES:
            return
        for rank in world.ranks.get(host, ()):
            if rank not in window.rank_exits and rank not in window.losses:
                in_round = self.run.round_in_progress(rank)
                if in_round is not None:
                    window.correct_loss_round(rank, in_round)

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None:
        """The host's join link ended (`lost`: it broke rather than closed cleanly). The window decides what
        that means (`JoinWindow.link_ended`); this logs it and acts on the phase.
        """
        if link.closed.is_set():
            return
        link.closed.set()
        if self.run.links.get(link.host) is link:
            del self.run.links[link.host]
        window = self.run.window
        if window is None:
            return
        self._estimate_loss_rounds(window, link.host)
        ended = window.link_ended(link.host, self.run.clock(), clean=not lost, why=why)
        if ended.outcome is LinkOutcome.IGNORED:
            if window.phase not in TERMINAL_PHASES:
                self.run.settle()
            return
        if ended.outcome is LinkOutcome.RETURNED:
            log.warning(
                "event=host_left_before_formation host=%s peer=%s ranks_returned=%s why=%r",
                link.host,
                link.peer,
                list(ended.ranks),
                ended.why,
            )
        elif ended.outcome is LinkOutcome.LOST:
            log.warning("event=host_link_closed host=%s lost=%s why=%r", link.host, True, ended.why)
        else:
            self.run.storm_log.event(
                "host_link_closed",
                logging.INFO,
                "event=host_link_closed host=%s lost=%s why=%r",
                link.host,
                False,
                ended.why,
                detail=lambda: f"host={link.host}",
            )
        self.run.settle()
