"""Sans-io membership: the join window's policy, phase table and verdict, admission ledger, start
switch and state snapshot. Time is always an argument; nothing here does I/O.
"""

from __future__ import annotations

from flodld.membership.ledger import Admitted, Ledger, Member, Refused, World
from flodld.membership.phase import TRANSITIONS, Event, Phase, TransitionError, Verdict, advance, verdict
from flodld.membership.policy import PolicyError, StartMode, TrustMode, WindowPolicy, derive_policy
from flodld.membership.snapshot import ConnectionCounts, LinkState, StateSnapshot, state_schema
from flodld.membership.switch import Armed, StartRefused, arm, token_matches
from flodld.membership.window import JoinWindow, LinkEnded, LinkOutcome

__all__ = [
    "TRANSITIONS",
    "Admitted",
    "Armed",
    "ConnectionCounts",
    "Event",
    "JoinWindow",
    "Ledger",
    "LinkEnded",
    "LinkOutcome",
    "LinkState",
    "Member",
    "Phase",
    "PolicyError",
    "Refused",
    "StartMode",
    "StartRefused",
    "StateSnapshot",
    "TransitionError",
    "TrustMode",
    "Verdict",
    "WindowPolicy",
    "World",
    "advance",
    "arm",
    "derive_policy",
    "state_schema",
    "token_matches",
    "verdict",
]
