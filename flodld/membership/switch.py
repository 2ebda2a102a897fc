"""The operator's start switch (`POST /start`, `fdl start`): when arming is allowed, and why not.

Arming below quorum is refused, never queued, so the operator always knows what they started. Once
armed the switch stays armed; the verdict re-checks quorum and forms at its next evaluation. Who may
fire is the HTTP shell's decision (a loopback caller that is not a browser, or a valid start
credential checked with `token_matches`).

The start credential is not the session salt: it is `start_credential(salt, run_id)`, an HMAC of a
fixed label and the run id under the salt. It can arm the start of that one run and nothing else, so
sending it over plain HTTP (`fdl start --token` from another host) never hands an observer the salt,
which keys joins, the store and the data plane, and a credential seen once arms no later run of a
service that keeps its salt (a configured `controller.join.token`) from run to run. Whoever holds the
salt can compute it for the run id that state.json shows (`fdl start --derive-credential`); `flodld
serve` logs it when the start mode is manual or hybrid.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from flodld.membership.phase import WINDOW_PHASES, Phase
from flodld.membership.policy import StartMode, WindowPolicy

START_CREDENTIAL_LABEL = b"flodld/start/v2"


def start_credential(salt: bytes, run_id: str) -> str:
    """The start credential of run RUN_ID (64 hex characters).

    HMAC-SHA256(salt, "flodld/start/v2" NUL run_id as UTF-8): the run id binds it to one run, so
    runs that share a salt (a configured join token) never share a credential.
    """
    if not run_id:
        raise ValueError("start_credential needs the run id (state.json's run_id): the credential is per run")
    message = START_CREDENTIAL_LABEL + b"\x00" + run_id.encode("utf-8")
    return hmac.new(salt, message, hashlib.sha256).hexdigest()


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
            f"quorum not met: {joined_ranks} of {policy.quorum} ranks joined — check fdl status and fire "
            "again",
        )
    return Armed(joined_ranks=joined_ranks, quorum=policy.quorum, already=armed)


def forbidden() -> StartRefused:
    """The refusal for a caller that is neither a local CLI nor holding the start credential."""
    return StartRefused(
        "forbidden",
        403,
        "start refused: no valid start credential (pass --token with the start credential — not the join "
        "token; `fdl start --derive-credential` computes it — or fire `fdl start` from the controller host / "
        "through the sshd tunnel)",
    )


def token_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison of a presented start token with the run's (hex, case-insensitive)."""
    if presented is None or expected is None:
        return False
    return hmac.compare_digest(presented.strip().lower().encode(), expected.strip().lower().encode())
