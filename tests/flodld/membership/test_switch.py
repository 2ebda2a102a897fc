from __future__ import annotations

from typing import Any

import pytest

from flodld.membership.phase import Phase
from flodld.membership.switch import Armed, StartRefused, arm, forbidden, token_matches
from tests.flodld.membership.helpers import policy

# (name, knobs, phase, joined, code, fragment)
REFUSALS: list[tuple[str, dict[str, Any], Phase, int, str, str]] = [
    ("auto_mode", {}, Phase.WAITING, 2, "auto_mode", "start mode is auto"),
    ("below_quorum", {"start": "manual"}, Phase.WAITING, 1, "quorum_not_met", "quorum not met: 1 of 2 ranks"),
    (
        "forming",
        {"start": "manual"},
        Phase.FORMING,
        2,
        "window_closed",
        "window is not open (phase: forming)",
    ),
    ("failed", {"start": "hybrid"}, Phase.FAILED, 2, "window_closed", "(phase: failed)"),
    ("training", {"start": "hybrid"}, Phase.TRAINING, 2, "window_closed", "(phase: training)"),
]


@pytest.mark.parametrize(
    ("knobs", "phase", "joined", "code", "fragment"),
    [row[1:] for row in REFUSALS],
    ids=[row[0] for row in REFUSALS],
)
def test_start_refusals_name_their_reason(
    knobs: dict[str, Any], phase: Phase, joined: int, code: str, fragment: str
) -> None:
    decision = arm(policy(capacity=2, **knobs), phase, joined_ranks=joined, armed=False)
    assert isinstance(decision, StartRefused)
    assert (decision.code, decision.http_status) == (code, 409)
    assert fragment in decision.reason


@pytest.mark.parametrize("start", ["manual", "hybrid"])
@pytest.mark.parametrize("phase", [Phase.WAITING, Phase.STAGING])
def test_arming_with_quorum_is_accepted_and_idempotent(start: str, phase: Phase) -> None:
    window_policy = policy(capacity=2, start=start)
    assert arm(window_policy, phase, joined_ranks=3, armed=False) == Armed(3, 2, already=False)
    assert arm(window_policy, phase, joined_ranks=3, armed=True) == Armed(3, 2, already=True)


def test_forbidden_is_a_403() -> None:
    refusal = forbidden()
    assert (refusal.code, refusal.http_status) == ("forbidden", 403)
    assert "--token" in refusal.reason


@pytest.mark.parametrize(
    ("presented", "expected", "matches"),
    [
        ("00ff" * 8, "00ff" * 8, True),
        (" " + "00FF" * 8 + "\n", "00ff" * 8, True),
        ("00ff" * 8, "00fe" * 8, False),
        ("00ff", "00ff" * 8, False),
        (None, "00ff" * 8, False),
        ("00ff" * 8, None, False),
    ],
)
def test_token_check(presented: str | None, expected: str | None, matches: bool) -> None:
    assert token_matches(presented, expected) is matches
