"""Admission, rank look-ups, exit reports and snapshots cost the same at any world size (no O(N) scans).

Measured as the number of Python calls into flodld (generator resumptions included) that one operation
makes, via sys.setprofile: deterministic, unlike timing, and a scan over the members shows up as calls per
member. Calls outside flodld are not the operation's and are not counted: the interpreter may run other code
at any moment in the measured thread (a garbage collection's finalizers, a signal handler an earlier test
left in the same worker), and CI once counted 6 calls against 4 for the same exit report that way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import flodld
from flodld.membership.ledger import Admitted, Ledger, Refused
from flodld.membership.phase import Phase
from flodld.membership.window import JoinWindow

from .helpers import hello, phase_of, policy

FLODLD = str(Path(flodld.__file__).resolve().parent)


def python_calls(operation: Callable[[], object]) -> int:
    count = 0

    def profiler(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(FLODLD):
            count += 1

    sys.setprofile(profiler)
    try:
        operation()
    finally:
        sys.setprofile(None)
    return count


def ledger_with(members: int) -> Ledger:
    ledger = Ledger(policy(capacity=10_000, target_ranks=10_000, min_rank_start=1))
    for index in range(members):
        ledger.admit(hello(f"h{index:05d}", devices=2), float(index))
    return ledger


def test_one_admission_makes_as_many_calls_with_2000_members_as_with_10() -> None:
    small, large = ledger_with(10), ledger_with(2000)
    offer = hello("newcomer", devices=2)
    assert python_calls(lambda: small.admit(offer, 1.0)) == python_calls(lambda: large.admit(offer, 1.0))
    assert large.ranks_of("newcomer") == (4000, 4001)
    assert python_calls(lambda: small.ranks_of("h00005")) == python_calls(lambda: large.ranks_of("h01999"))
    assert python_calls(lambda: small.joined_ranks) == python_calls(lambda: large.joined_ranks)


def test_the_rank_index_follows_retractions() -> None:
    ledger = ledger_with(5)
    assert ledger.retract("h00001") == (2, 3)
    assert [ledger.ranks_of(f"h{i:05d}") for i in (0, 2, 3, 4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert ledger.joined_ranks == 8
    assert ledger.admit(hello("late", devices=3), 9.0).ranks == (8, 9, 10)  # type: ignore[union-attr]
    assert ledger.freeze().world_size == 11


def trained_window(hosts: int) -> JoinWindow:
    window = JoinWindow(policy(capacity=hosts, target_ranks=hosts, min_rank_start=hosts), [], 0.0)
    for index in range(hosts):
        window.hello(hello(f"h{index:05d}"), 0.1)
    window.form(0.2)
    window.artifacts_shipped(0.3)
    assert window.phase is Phase.TRAINING
    return window


def test_an_exit_report_costs_the_same_in_a_world_of_2000_as_of_10() -> None:
    small, large = trained_window(10), trained_window(2000)
    small.rank_exited(2, 0, 1.0)  # the frozen world computes its size once, on first use
    large.rank_exited(2, 0, 1.0)
    assert python_calls(lambda: small.rank_exited(3, 0, 1.0)) == python_calls(
        lambda: large.rank_exited(3, 0, 1.0)
    )
    assert python_calls(lambda: small.host_closed("h00003", 1.0)) == python_calls(
        lambda: large.host_closed("h00003", 1.0)
    )
    assert large.phase is Phase.TRAINING


def test_running_totals_agree_with_the_verdict() -> None:
    window = trained_window(4)
    window.host_closed("h00001", 1.0, lost=True, why="rank 1 went silent")
    assert window.failed_ranks() == [1]
    assert window.phase is Phase.FAILED
    assert "host 'h00001' lost: rank 1 went silent" in window.reason

    tolerant = JoinWindow(policy(capacity=3, target_ranks=3, min_rank_start=3), [], 0.0, tolerance=1)
    for index in range(3):
        tolerant.hello(hello(f"h{index}"), 0.1)
    tolerant.form(0.2)
    tolerant.artifacts_shipped(0.3)
    tolerant.rank_exited(0, 0, 1.0)
    tolerant.host_closed("h0", 1.0)
    tolerant.host_closed("h1", 1.0, lost=True)  # rank 1 never reported: one failure, within tolerance
    assert tolerant.failed_ranks() == [1]
    tolerant.rank_exited(2, 0, 1.0)
    assert tolerant.phase is Phase.TRAINING
    tolerant.host_closed("h2", 1.0)
    assert phase_of(tolerant) is Phase.DONE
    assert "degraded: ranks [1] lost" in tolerant.reason


def test_a_snapshot_makes_calls_in_proportion_to_the_members_only() -> None:
    small, large = ledger_with(100), ledger_with(1000)
    # a roster as large as the fleet, each with one host missing: `missing` must not scan members per host
    window_small = JoinWindow(small.policy, [f"h{i:05d}" for i in range(101)], 0.0)
    window_large = JoinWindow(large.policy, [f"h{i:05d}" for i in range(1001)], 0.0)
    window_small.ledger, window_large.ledger = small, large
    per_small = python_calls(lambda: window_small.snapshot(1.0))
    per_large = python_calls(lambda: window_large.snapshot(1.0))
    assert per_large <= 10 * per_small + 100  # linear in members, not quadratic
    assert window_large.snapshot(1.0).missing == ["h01000"]


def test_a_window_of_20000_hosts_forms_every_rank_once_in_admission_order() -> None:
    """The 20,000-host world of issue 18, at the protocol core: the socket storm cannot run on a machine
    whose descriptor limit is 20,000 (the controller needs one per host), the state machine can.
    """
    hosts = 20_000
    window = JoinWindow(policy(capacity=hosts, target_ranks=hosts, min_rank_start=1), [], 0.0)
    for index in range(hosts):
        outcome = window.hello(hello(f"h{index:05d}"), 0.001, evaluate=False)
        assert isinstance(outcome, Admitted) and outcome.ranks == (index,), outcome
    window.tick(0.002)  # the storm's one evaluation per turn, after the last hello reached the target
    assert window.phase is Phase.FORMING
    world = window.form(0.003)
    assert world is not None and world.world_size == hosts
    assert window.world_size() == hosts
    assert [world.ranks[f"h{index:05d}"] for index in (0, 9_999, 19_999)] == [(0,), (9_999,), (19_999,)]
    late = window.hello(hello("h-late"), 0.004)
    assert isinstance(late, Refused), late  # the world is formed: a late host is refused, never queued
