"""Which freed slots heal in, and under what name: a pure decision, time passed in (flodld/agent/host.py
carries it out; docs/elastic-averaging.md, "Slots heal in place").

A run that grows (`RelaySpec.grows`) admits walk-ins during training. A rank that fails on its own or is
declared dead there frees its device while its host-mates keep training (ReportRankExit.frees_slot,
flodld/agent/supervision.py). Folded out, it would cost the run that rank's share of every round until the
whole host walked in again, which a host whose agent still runs never does. So the agent offers the freed
device at once as a walk-in of its own, host `HOST+N`: it enters through the ordinary walk-in path (admission
within `elastic_max_ranks`, Entry at a round boundary, the averaged state before its first deposit), with its
own relay, on the same token.

Rules:
- at most `HEALS` slots per `HEALS_WINDOW_SECS` seconds: a rank that fails at every start is a bug, not bad
  luck, and its slot then stays empty, said, instead of crash-looping (the burst limit `fdl join --persist`
  puts on its quick re-dials, for the same reason, as systemd's StartLimitBurst does);
- none once the agent is stopping (a signal), or once its host's own shell has finished and nothing of the
  host trains in the run any more (flodld/agent/host.py closes them): a walk-in then would join the next run
  beside the host's own re-dial;
- each healed slot gets a fresh name (`HOST+1`, `HOST+2`, ...): a slot that fails again heals under the next,
  so the controller never sees two live links with one host name.
"""

from __future__ import annotations

from typing import Final

from flodld.wire.messages import MAX_HOST_CHARS

HEALS: Final = 3
HEALS_WINDOW_SECS: Final = 60.0
HEAL_SEPARATOR: Final = "+"  # HOST+N: a healed slot's walk-in host name


class BurstLimit:
    """At most `count` events in any `window` seconds (a sliding window over the times `allow` said yes)."""

    def __init__(self, count: int, window: float) -> None:
        self.count = count
        self.window = window
        self._at: list[float] = []

    def allow(self, now: float) -> bool:
        """Whether one more event fits at `now` (it is then counted)."""
        self._at = [at for at in self._at if now - at < self.window]
        if len(self._at) >= self.count:
            return False
        self._at.append(now)
        return True


class SlotStaysEmpty(Exception):
    """A freed slot does not heal in; the message says why (the agent says it)."""


class SlotHeals:
    """The agent's healed slots: names them and keeps their rate bounded."""

    def __init__(self, host: str, *, heals: int = HEALS, window: float = HEALS_WINDOW_SECS) -> None:
        self.host = host
        self.burst = BurstLimit(heals, window)
        self.healed = 0  # slots healed so far: the next walk-in is HOST+(healed+1)
        self.closed: str | None = None  # why no slot heals any more

    def freed(self, now: float) -> str:
        """A rank's slot was freed at `now`: the host name its walk-in takes (SlotStaysEmpty: why none)."""
        if self.closed is not None:
            raise SlotStaysEmpty(self.closed)
        if not self.burst.allow(now):
            raise SlotStaysEmpty(
                f"{self.burst.count} slots healed within {self.burst.window:g}s already: a rank that fails "
                "at every start is a bug to fix, not a slot to fill; its slot stays empty until the host "
                "re-joins"
            )
        self.healed += 1
        suffix = f"{HEAL_SEPARATOR}{self.healed}"
        return self.host[: MAX_HOST_CHARS - len(suffix)] + suffix

    def close(self, reason: str) -> None:
        """No slot heals from now on (the agent is stopping, or nothing of its host trains in the run)."""
        if self.closed is None:
            self.closed = reason
