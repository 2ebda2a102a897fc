"""The run's admissions: the window decides a hello; its Accept and host key go on the link at once.

All window calls happen on the event loop thread, synchronously, so an admission and its Accept write are
never interleaved with another admission: ranks stay contiguous without a lock. A hello is decided at once
but the verdict after it is evaluated once per event-loop turn (a storm of hellos costs one evaluation per
turn, and the window still closes at the hello that reaches the target).
"""

from __future__ import annotations

import asyncio
import logging

from flodld.controller.join import CHANNEL as JOIN_CHANNEL
from flodld.controller.join import HostLink
from flodld.controller.runparts import AdmissionRun
from flodld.membership.ledger import Refused
from flodld.membership.policy import TrustMode
from flodld.wire.hostkey import join_host_key
from flodld.wire.join import Accept, Hello, Reject

log = logging.getLogger("flodld.controller")


class Admissions:
    """`run`'s join decisions (the Controller hands the join channel's `refuse` and `admit` on to it)."""

    def __init__(self, run: AdmissionRun) -> None:
        self.run = run
        self._settle_pending = False

    def refuse(self, peer: str, code: str, reason: str) -> None:
        """Count and log a join attempt refused before it reached the ledger."""
        if self.run.window is not None:
            self.run.window.ledger.refuse(code, reason)
        else:
            self.run.counters.refusals[code] += 1
        self.run.storm_log.event(
            "join_refused",
            logging.WARNING,
            "event=join_refused peer=%s code=%s reason=%r",
            peer,
            code,
            reason,
            detail=lambda: f"peer={peer} code={code}",
        )

    def admit(self, hello: Hello, link: HostLink, *, kept: bool = False) -> Accept | Reject:
        """Decide a hello and, on admission, queue the Accept on the link in the same step.

        `kept`: a host linked since an earlier attempt (docs/restarts.md), re-admitted with the hello it
        first sent: its Accept carries this attempt's salt (under the earlier attempt's keys, which it holds)
        and the link is rekeyed to it, under either trust mode.
        """
        window = self.run.window
        if window is None:
            self.refuse(link.peer, "window_not_open", "the join window is not open yet")
            return Reject(
                code="window_not_open", reason="the join window is not open yet; dial again shortly"
            )
        now = self.run.clock()
        outcome = window.hello(hello, now, evaluate=False)
        if isinstance(outcome, Refused):
            code = outcome.code
            self.run.storm_log.event(
                "join_refused",
                logging.WARNING,
                "event=join_refused peer=%s host=%s code=%s reason=%r",
                link.peer,
                hello.host,
                code,
                outcome.reason,
                detail=lambda: f"peer={link.peer} host={hello.host} code={code}",
            )
            self._settle_this_turn()
            return Reject(code=outcome.code, reason=outcome.reason[:1024])
        open_admission = self.run.policy.trust is TrustMode.OPEN
        accept = Accept(
            ranks=list(outcome.ranks),
            salt_hex=self.run.salt_hex if open_admission or kept else None,
            formation_wait_secs=window.formation_wait_secs(now),
            run_id=self.run.run_id,
        )
        link.host_key = join_host_key(
            self.run.salt, host=hello.host, run_id=self.run.run_id, conn=link.stream.conn
        )
        link.stream.send_nowait(accept)
        self.run.counters.frame_out(JOIN_CHANNEL, 0)
        if open_admission or kept:
            link.stream.rekey(self.run.salt)
        self.run.links[hello.host] = link
        joined = window.ledger.joined_ranks
        self.run.storm_log.event(
            "joined",
            logging.INFO,
            "event=joined host=%s peer=%s ranks=%s devices=%d variant=%s joined_ranks=%d target=%s quorum=%d",
            hello.host,
            link.peer,
            list(outcome.ranks),
            len(hello.devices),
            hello.variant,
            joined,
            self.run.policy.target,
            self.run.policy.quorum,
            detail=lambda: f"host={hello.host} joined_ranks={joined}",
        )
        if window.world is not None:  # a walk-in during training (docs/elastic-averaging.md, growth)
            self.run.walk_in(hello.host, outcome.ranks, hello.rides)
        self._settle_this_turn()
        return accept

    def _settle_this_turn(self) -> None:
        """Evaluate the verdict once at the end of this event-loop turn, however many hellos it admitted."""
        if not self._settle_pending:
            self._settle_pending = True
            asyncio.get_running_loop().call_soon(self._turn_settle)

    def _turn_settle(self) -> None:
        self._settle_pending = False
        window = self.run.window
        if window is None or self.run.result is not None:
            return
        window.tick(self.run.clock())
        self.run.settle()
