from __future__ import annotations

from typing import Any

import pytest

from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.membership.policy import (
    OPEN_ADMISSION_WARNING,
    PolicyError,
    StartMode,
    TrustMode,
    derive_policy,
)
from tests.flodld.membership.helpers import policy

TOKEN = "0123456789abcdef0123456789abcdef"


def test_fan_out_defaults_make_quorum_and_target_the_capacity() -> None:
    p = policy(capacity=3)
    assert (p.quorum, p.target) == (3, 3)
    assert (p.window_secs, p.cap_secs) == (300.0, 600.0)
    assert p.start is StartMode.AUTO
    assert p.trust is TrustMode.PRESHARED
    assert p.warning is None


def test_hard_cap_defaults_to_the_window_when_the_window_is_longer_than_600s() -> None:
    assert policy(join_timeout=900).cap_secs == 900.0
    assert policy(join_timeout=100).cap_secs == 600.0
    assert policy(join_timeout=100, max_join_timeout=150).cap_secs == 150.0


def test_explicit_quorum_and_target_override_the_capacity() -> None:
    p = policy(capacity=4, min_rank_start=2, target_ranks=6)
    assert (p.quorum, p.target) == (2, 6)


def test_manual_mode_has_no_target() -> None:
    p = policy(capacity=4, start="manual")
    assert (p.quorum, p.target, p.start) == (4, None, StartMode.MANUAL)


def test_discovery_leaves_the_target_unset_and_ignores_capacity() -> None:
    p = policy(capacity=0, discovery=True, min_rank_start=2)
    assert (p.quorum, p.target, p.discovery) == (2, None, True)
    assert p.admits_walk_ins


@pytest.mark.parametrize(
    ("knobs", "capacity", "walk_ins"),
    [
        ({}, 2, False),
        ({"target_ranks": 3}, 2, True),
        ({"start": "manual"}, 2, False),
        ({"start": "manual", "min_rank_start": 3}, 2, True),
        ({"discovery": True, "min_rank_start": 1}, 2, True),
    ],
)
def test_walk_ins_are_admitted_only_when_the_window_waits_beyond_the_roster(
    knobs: dict[str, Any], capacity: int, walk_ins: bool
) -> None:
    assert policy(capacity=capacity, **knobs).admits_walk_ins is walk_ins


@pytest.mark.parametrize(
    ("knobs", "loopback_bind", "trust", "warned"),
    [
        ({}, False, TrustMode.PRESHARED, False),
        ({"token": TOKEN}, False, TrustMode.PRESHARED, False),
        ({"token": TOKEN}, True, TrustMode.PRESHARED, False),
        ({}, True, TrustMode.OPEN, False),
        ({"open_admission": True}, False, TrustMode.OPEN, True),
        ({"open_admission": True}, True, TrustMode.OPEN, False),
        ({"discovery": True, "min_rank_start": 1, "tunnel_only": True}, False, TrustMode.OPEN, False),
    ],
)
def test_trust_mode_follows_token_then_bind_scope_then_open_admission(
    knobs: dict[str, Any], loopback_bind: bool, trust: TrustMode, warned: bool
) -> None:
    p = policy(loopback_bind=loopback_bind, **knobs)
    assert p.trust is trust
    assert (p.warning == OPEN_ADMISSION_WARNING) is warned


def test_tunnel_only_binds_loopback() -> None:
    assert policy(discovery=True, min_rank_start=1, tunnel_only=True).loopback_bind


CPU_SYNC, NCCL_SYNC = AveragingMode.CPU_SYNC, AveragingMode.NCCL_SYNC

CONTRADICTIONS: list[tuple[str, dict[str, Any], int, AveragingMode, tuple[str, ...]]] = [
    ("discovery_without_quorum", {"discovery": True}, 0, CPU_SYNC, ("discovery", "min_rank_start")),
    (
        "manual_with_target",
        {"start": "manual", "target_ranks": 2},
        2,
        CPU_SYNC,
        ("start: manual", "target_ranks"),
    ),
    (
        "token_and_open_admission",
        {"token": TOKEN, "open_admission": True},
        2,
        CPU_SYNC,
        ("token", "open_admission"),
    ),
    ("tunnel_only_without_discovery", {"tunnel_only": True}, 2, CPU_SYNC, ("tunnel_only", "discovery")),
    (
        "tunnel_only_under_nccl",
        {"tunnel_only": True, "discovery": True, "min_rank_start": 1},
        0,
        NCCL_SYNC,
        ("tunnel_only", "averaging", "cpu_sync"),
    ),
    (
        "quorum_above_target",
        {"min_rank_start": 3, "target_ranks": 2},
        4,
        CPU_SYNC,
        ("min_rank_start", "target_ranks"),
    ),
    (
        "quorum_above_capacity",
        {"min_rank_start": 3},
        2,
        CPU_SYNC,
        ("min_rank_start", "target_ranks", "capacity 2"),
    ),
    (
        "discovery_quorum_above_target",
        {"discovery": True, "min_rank_start": 3, "target_ranks": 2},
        0,
        CPU_SYNC,
        ("min_rank_start", "target_ranks"),
    ),
    (
        "cap_below_window",
        {"join_timeout": 300, "max_join_timeout": 200},
        2,
        CPU_SYNC,
        ("max_join_timeout", "join_timeout"),
    ),
    ("empty_roster_without_discovery", {}, 0, CPU_SYNC, ("workers", "discovery")),
]


@pytest.mark.parametrize(
    ("knobs", "capacity", "averaging", "named"),
    [row[1:] for row in CONTRADICTIONS],
    ids=[row[0] for row in CONTRADICTIONS],
)
def test_every_knob_contradiction_names_both_knobs(
    knobs: dict[str, Any], capacity: int, averaging: AveragingMode, named: tuple[str, ...]
) -> None:
    with pytest.raises(PolicyError) as caught:
        derive_policy(JoinConfig(**knobs), capacity=capacity, loopback_bind=False, averaging=averaging)
    for word in named:
        assert word in str(caught.value)


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(PolicyError, match="capacity"):
        derive_policy(JoinConfig(), capacity=-1, loopback_bind=False, averaging=CPU_SYNC)


def test_summary_states_the_window_for_the_log() -> None:
    line = policy(capacity=2, start="hybrid", join_timeout=30).summary()
    assert line == (
        "join window open (start hybrid, quorum 2 ranks, target 2, window 30s, cap 600s, admission: "
        "pre-shared salt)"
    )


# --- trust follows the address actually bound (issue 13, point 4) ---------------------------------


@pytest.mark.parametrize(
    ("knobs", "loopback_bind", "bound", "preshared", "trust", "network_warning"),
    [
        (
            {},
            True,
            "127.0.0.1",
            False,
            TrustMode.OPEN,
            False,
        ),  # tunneled workers, loopback: sshd is the check
        ({}, True, "::1", False, TrustMode.OPEN, False),
        ({}, True, "::ffff:127.0.0.1", False, TrustMode.OPEN, False),
        ({}, True, "0.0.0.0", False, TrustMode.PRESHARED, False),  # intent says loopback, the bind does not
        ({}, True, "10.1.2.3", False, TrustMode.PRESHARED, False),
        ({}, True, "::", False, TrustMode.PRESHARED, False),
        ({}, True, "127.0.0.1", True, TrustMode.PRESHARED, False),  # fan-out: agents get the salt over SSH
        ({"open_admission": True}, False, "0.0.0.0", False, TrustMode.OPEN, True),  # explicit, and loud
        ({"open_admission": True}, True, "0.0.0.0", True, TrustMode.OPEN, True),
        ({"open_admission": True}, False, "127.0.0.1", False, TrustMode.OPEN, False),
        (
            {"discovery": True, "min_rank_start": 1, "tunnel_only": True},
            False,
            "127.0.0.2",
            False,
            TrustMode.OPEN,
            False,
        ),
    ],
)
def test_trust_follows_the_bound_address(
    knobs: dict[str, Any],
    loopback_bind: bool,
    bound: str,
    preshared: bool,
    trust: TrustMode,
    network_warning: bool,
) -> None:
    p = derive_policy(JoinConfig(**knobs), capacity=2, loopback_bind=loopback_bind, averaging=CPU_SYNC,
                      bound_address=bound, preshared=preshared)  # fmt: skip
    assert p.trust is trust
    assert p.loopback_bind is (bound in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.2"))
    assert (p.warning is not None and "NOT loopback" in p.warning and bound in p.warning) is network_warning


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", "192.168.1.5", "localhost-ish.example"])
def test_tunnel_only_on_a_non_loopback_bind_names_both_knobs_and_the_fix(bound: str) -> None:
    with pytest.raises(PolicyError) as caught:
        derive_policy(JoinConfig(discovery=True, min_rank_start=1, tunnel_only=True), capacity=0,
                      loopback_bind=False, averaging=CPU_SYNC, bound_address=bound)  # fmt: skip
    text = str(caught.value)
    for word in ("tunnel_only", "--tunnel-only", "--bind", bound, "127.0.0.1", "--token"):
        assert word in text
