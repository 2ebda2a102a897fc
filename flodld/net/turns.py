"""Turn budgets: at most N CPU-bound steps of many connections per event-loop turn, the rest in order in
later turns, so that a storm of handshakes cannot make every turn long (`TurnBudget`), and the one budget
per loop that the join channel's handshakes share (`join_turns`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Callable

log = logging.getLogger("flodld.net.turns")

# Join handshakes that may run their CPU-bound steps (key derivation and the dialer's nonce; the hello's
# decoding and admission) in one event-loop turn. A storm of thousands of dialers otherwise makes every
# turn run one step of each of them, and an HTTP request (several turns from accept to answer) waits
# behind each such turn: a poll took seconds. Waiting here holds nothing (a place in line for a later
# turn, not a slot kept while the peer is slow), so a silent or slow peer cannot hold up the others.
# The knob trades storm throughput for the other requests' latency. 24 since state.json is answered without
# aiohttp and deadlines share a timer (10,000-agent storms, 2026-12-03, alternating runs: admissions/s
# 0.61-0.73 of the baseline at 16, 0.65-0.78 at 24, 0.68-0.75 at 32; state.json p99 27-33 ms at 16, 28-44 ms
# at 24, 30-90 ms at 32). Before that: 16 (p99 43-48 ms at 16, 63-95 ms at 32, 38-39 ms at 8).
JOIN_STEPS_PER_TURN = 24


class TurnBudget:
    """At most `per_turn` steps given to `call()` run per event-loop turn; the others wait, in order, for
    later turns. Sans-io apart from the loop's `call_soon`.
    """

    def __init__(self, per_turn: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if per_turn < 1:
            raise ValueError(f"a turn budget lets >= 1 step through, got {per_turn}")
        self.per_turn = per_turn
        self._loop = loop  # None: the running loop, asked when a turn is scheduled
        self._used = 0
        self._waiters: deque[Callable[[], None]] = deque()
        self._refill_scheduled = False
        self.deferred = 0
        """How many steps waited for a later turn (for tests and diagnostics)."""

    def call(self, step: Callable[[], None]) -> None:
        """Run `step` now if this turn's budget allows (and nobody waits), else in a later turn, in order.

        A step that raises is logged; the turn goes on. A step whose connection ended meanwhile still takes
        its place in line (it returns at once: the join protocol's steps check their state first).
        """
        if self._used < self.per_turn and not self._waiters:
            self._used += 1
            self._schedule_refill()
            step()
            return
        self._waiters.append(step)
        self.deferred += 1
        self._schedule_refill()

    def _schedule_refill(self) -> None:
        if not self._refill_scheduled:
            self._refill_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._refill)

    def _refill(self) -> None:
        """Runs once per turn while anything is counted or waiting: a new turn's budget, first to waiters."""
        self._refill_scheduled = False
        self._used = 0
        while self._waiters and self._used < self.per_turn:
            step = self._waiters.popleft()
            self._used += 1
            try:
                step()
            except Exception:
                log.exception("event=join_step_failed")
        if self._used or self._waiters:
            self._schedule_refill()


_BUDGETS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnBudget] = weakref.WeakKeyDictionary()
# The last loop asked about and its budget: a controller has one loop, and a WeakKeyDictionary lookup
# (a new weak reference per call) cost ~30 us per join under a storm.
_LAST: tuple[weakref.ref[asyncio.AbstractEventLoop], TurnBudget] | None = None



def join_turns(loop: asyncio.AbstractEventLoop | None = None) -> TurnBudget:
    """`loop`'s join-step budget (one per loop: every run on a controller port shares it); by default the
    running loop's (under Python 3.11 asking for it is a getpid() system call: callers that know it pass it).
    """
    global _LAST
    if loop is None:
        loop = asyncio.get_running_loop()
    last = _LAST
    if last is not None and last[0]() is loop:
        return last[1]
    budget = _BUDGETS.get(loop)
    if budget is None:
        budget = _BUDGETS[loop] = TurnBudget(JOIN_STEPS_PER_TURN, loop)
    _LAST = (weakref.ref(loop), budget)
    return budget
