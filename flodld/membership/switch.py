"""The operator's start switch (`POST /start`, `fdl start`): when arming is allowed, and why not.

Arming below quorum is refused, never queued, so the operator always knows what they started. Once
armed the switch stays armed; the verdict re-checks quorum and forms at its next evaluation. Who may
fire is the HTTP shell's decision (loopback, or a valid token checked with `token_matches`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from flodld.membership.phase import WINDOW_PHASES, Phase
from flodld.membership.policy import StartMode, WindowPolicy


@dataclass(frozen=True)
class Armed:
    """The switch is armed; `already` says it was armed before this request."""

    joined_ranks: int
    quorum: int
    already: bool = False


@dataclass(frozen=True)
class StartRefused:
    """Why the start was refused: a stable code, the HTTP status to answer with, and a sentence."""

    code: str
    http_status: int
    reason: str


def arm(policy: WindowPolicy, phase: Phase, *, joined_ranks: int, armed: bool) -> Armed | StartRefused:
    """Decide a start request against the mode, the phase and the quorum (in that order)."""
    if policy.start is StartMode.AUTO:
        return StartRefused(
            "auto_mode",
            409,
            "start mode is auto — the window closes on target/expiry; set controller.join.start: manual "
            "(or hybrid) to hold for an operator start",
        )
    if phase not in WINDOW_PHASES:
        return StartRefused("window_closed", 409, f"window is not open (phase: {phase.value})")
    if joined_ranks < policy.quorum:
        return StartRefused(
            "quorum_not_met",
            409,
            f"quorum not met: {joined_ranks} of {policy.quorum} ranks joined — check fdl status and fire again",
        )
    return Armed(joined_ranks=joined_ranks, quorum=policy.quorum, already=armed)


def forbidden() -> StartRefused:
    """The refusal for a caller that is neither local nor holding the run token."""
    return StartRefused(
        "forbidden",
        403,
        "start refused: non-loopback caller without a valid token (pass --token, or fire from the "
        "controller host / through the sshd tunnel)",
    )


def token_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison of a presented start token with the run's (hex, case-insensitive)."""
    if presented is None or expected is None:
        return False
    return hmac.compare_digest(presented.strip().lower().encode(), expected.strip().lower().encode())
