"""Growth during training (flodld/membership/growth.py and `JoinWindow.walk_in`): who may walk in, which
ranks it gets, what the window counts afterwards (docs/elastic-averaging.md, "Growth and healing").
"""

from __future__ import annotations

from flodld.membership.growth import growth_refusal
from flodld.membership.ledger import Admitted, Refused
from flodld.membership.phase import Phase
from flodld.membership.snapshot import LinkState
from flodld.membership.window import JoinWindow
from tests.flodld.membership.helpers import hello, policy

T0 = 1000.0


def training(bound: int | None = 4, tolerance: int = 1) -> JoinWindow:
    """Hosts a (ranks 0, 1) and b (rank 2) in training, growth bounded by `bound`."""
    w = JoinWindow(policy(capacity=3), [], T0, tolerance=tolerance, elastic_max_ranks=bound)
    for host, devices in (("a", 2), ("b", 1)):
        assert isinstance(w.hello(hello(host, devices), T0 + 1), Admitted)
    assert w.tick(T0 + 2) is Phase.FORMING
    w.form(T0 + 2)
    assert w.artifacts_shipped(T0 + 2) is Phase.TRAINING
    return w


def test_the_decision_table() -> None:
    common = {"host": "c", "offered": 1, "link": None}
    assert growth_refusal(phase=Phase.TRAINING, bound=4, live_ranks=3, **common) is None  # type: ignore[arg-type]
    no_growth = growth_refusal(phase=Phase.TRAINING, bound=None, live_ranks=3, **common)  # type: ignore[arg-type]
    assert no_growth is not None and no_growth.code == "window_closed"
    assert "elastic_max_ranks" in no_growth.reason
    forming = growth_refusal(phase=Phase.FORMING, bound=4, live_ranks=3, **common)  # type: ignore[arg-type]
    assert forming is not None and forming.code == "window_closed"
    full = growth_refusal(phase=Phase.TRAINING, bound=3, live_ranks=3, **common)  # type: ignore[arg-type]
    assert full is not None and full.code == "elastic_full"
    assert "trains 3 live rank(s) of at most 3 (elastic_max_ranks)" in full.reason
    twice = growth_refusal(
        host="b", phase=Phase.TRAINING, bound=9, live_ranks=3, offered=1, link=LinkState.OPEN
    )
    assert twice is not None and twice.code == "duplicate_host"
    back = growth_refusal(
        host="b", phase=Phase.TRAINING, bound=9, live_ranks=2, offered=1, link=LinkState.LOST
    )
    assert back is None


def test_a_walk_in_gets_fresh_ranks_and_is_recorded_with_the_round_it_entered() -> None:
    w = training()
    outcome = w.hello(hello("c", 1), T0 + 5)
    assert isinstance(outcome, Admitted) and outcome.ranks == (3,)
    assert w.world is not None and w.world.world_size == 4 and w.world.ranks["c"] == (3,)
    assert w.links["c"] is LinkState.OPEN and w.live_ranks() == 4
    assert [j.state()["round"] for j in w.joins.values()] == [None]
    w.entered((3,), 7)
    assert w.state(T0 + 6)["joins"] == [{"rank": 3, "host": "c", "round": 7, "at_secs": 5.0}]
    refused = w.hello(hello("d", 1), T0 + 6)  # four live ranks of at most four
    assert isinstance(refused, Refused) and refused.code == "elastic_full"
    assert w.ledger.refused_counts["elastic_full"] == 1
    # The walk-in's link counts: the run ends once every link closed, the walk-in's included.
    for host in ("a", "b"):
        w.host_closed(host, T0 + 9)
    assert w.phase is Phase.TRAINING
    assert w.host_closed("c", T0 + 9) is Phase.DONE


def test_a_lost_host_walks_in_again_under_its_name_with_fresh_ranks() -> None:
    w = training(bound=3)
    w.host_closed("b", T0 + 3, lost=True, why="agent killed")
    assert w.failed_ranks() == [2] and w.live_ranks() == 2
    outcome = w.hello(hello("b", 1), T0 + 4)
    assert isinstance(outcome, Admitted) and outcome.ranks == (3,)  # rank 2's id is never reused
    assert w.links["b"] is LinkState.OPEN and w.live_ranks() == 3
    assert w.failed_ranks() == [2]  # the lost rank stays lost (and counted against the tolerance)
    assert w.ledger.ranks_of("b") == (3,)
    w.rank_exited(3, 0, T0 + 8)
    for host in ("a", "b"):
        w.host_closed(host, T0 + 9)
    assert w.phase is Phase.DONE and "degraded: ranks [2] lost" in w.reason


def test_the_first_host_walking_in_again_after_another_walk_in_holds_two_rank_ranges() -> None:
    """Host a (ranks 0, 1, the formed world's first host) is lost; c walks in (rank 3); a walks in again
    (ranks 4, 5): a's ranks in the world are (0, 1, 4, 5), not one contiguous range, so nothing may build an
    envelope from a host's whole list (`WorldShipper._envelope_template` took the first host's: the chaos
    bench's "ranks [0, 1, 10, 11] are not contiguous" verdict). When a's link breaks again, only its current
    ranks are lost with it.
    """
    w = training(bound=4, tolerance=2)
    w.host_closed("a", T0 + 3, lost=True, why="partitioned")
    assert isinstance(w.hello(hello("c", 1), T0 + 4), Admitted)
    outcome = w.hello(hello("a", 2), T0 + 5)
    assert isinstance(outcome, Admitted) and outcome.ranks == (4, 5)
    assert w.world is not None and w.world.ranks["a"] == (0, 1, 4, 5)
    assert w.disconnect("a", T0 + 6) == (4, 5)
    assert w.failed_ranks() == [0, 1, 4, 5]


def test_no_bound_keeps_the_window_closed_after_formation() -> None:
    w = training(bound=None)
    refused = w.hello(hello("c", 1), T0 + 5)
    assert isinstance(refused, Refused) and refused.code == "window_closed"
    assert w.world is not None and w.world.world_size == 3


# The tolerance bounds the current deficit once the world can heal: (events, phase after, deficit). Events on
# `training(tolerance=1)` (a: ranks 0, 1; b: rank 2): "lose X" loses host X's link, "walk X" walks X in with
# one rank (admitted), "enter R" has rank R enter the averaging, "exit R" is rank R exiting 1.
HEALING = [
    (["lose b"], Phase.TRAINING, 1),
    (["lose b", "walk b"], Phase.TRAINING, 1),  # admitted but not entered: still missing
    (["lose b", "walk b", "enter 3"], Phase.TRAINING, 0),
    (["lose b", "walk b", "enter 3", "lose b"], Phase.TRAINING, 1),  # the walk-in lost in turn
    (["lose b", "walk b", "enter 3", "lose b", "walk b", "enter 4"], Phase.TRAINING, 0),
    (["lose b", "walk b", "exit 0"], Phase.FAILED, 2),  # a loss before the walk-in entered
    (["lose b", "walk b", "enter 3", "exit 0"], Phase.TRAINING, 1),
    (["lose b", "walk b", "enter 3", "exit 0", "exit 1"], Phase.FAILED, 2),
    (["walk c", "enter 3", "exit 0"], Phase.TRAINING, 0),  # growth beyond the formed world is a cushion
]


def _replay(w: JoinWindow, events: list[str]) -> None:
    now = T0 + 3
    for event in events:
        verb, what = event.split()
        now += 1
        if verb == "lose":
            w.host_closed(what, now, lost=True, why="agent killed")
        elif verb == "walk":
            assert isinstance(w.hello(hello(what, 1), now), Admitted)
        elif verb == "enter":
            w.entered((int(what),), int(what) + 10)
        else:
            w.rank_exited(int(what), 1, now)


def test_with_growth_the_tolerance_bounds_the_ranks_missing_now() -> None:
    for events, phase, missing in HEALING:
        w = training(bound=4, tolerance=1)
        _replay(w, events)
        assert (w.phase, w.missing_ranks()) == (phase, missing), events


def test_without_growth_every_loss_of_the_run_counts() -> None:
    w = JoinWindow(policy(capacity=3), [], T0, tolerance=1)
    for host, devices in (("a", 2), ("b", 1)):
        assert isinstance(w.hello(hello(host, devices), T0 + 1), Admitted)
    w.tick(T0 + 2)
    w.form(T0 + 2)
    w.artifacts_shipped(T0 + 2)
    w.host_closed("b", T0 + 3, lost=True)
    assert w.missing_ranks() == 1 and w.phase is Phase.TRAINING
    refused = w.hello(hello("b", 1), T0 + 4)  # no growth: nothing heals the deficit
    assert isinstance(refused, Refused) and refused.code == "window_closed"
    assert w.rank_exited(0, 1, T0 + 5) is Phase.FAILED
    assert "2 of 3 ranks failed (ranks [0, 2]), over the tolerance of 1" in w.reason


def test_the_verdicts_name_the_deficit_the_losses_and_the_joins() -> None:
    w = training(bound=4, tolerance=1)
    _replay(w, ["lose b", "walk b", "enter 3", "exit 0", "exit 1"])
    assert w.reason.startswith(
        "2 ranks missing of the 3 formed (3 lost: ranks [0, 1, 2], 1 healed in: ranks [3]), over the "
        "tolerance of 1"
    ), w.reason
    healed = training(bound=4, tolerance=1)
    _replay(healed, ["lose b", "walk b", "enter 3", "lose b", "walk b", "enter 4"])
    healed.rank_exited(4, 0, T0 + 20)
    for host in ("a", "b"):
        healed.host_closed(host, T0 + 21)
    assert healed.phase is Phase.DONE, healed.reason
    assert "degraded: ranks [2, 3] lost: rank 2 on 'b' lost with its host" in healed.reason, healed.reason
    assert "ranks [3, 4] healed in: rank 3 on 'b' in round 13; rank 4 on 'b' in round 14" in healed.reason


def test_a_percentage_tolerance_is_fixed_at_formation_under_growth() -> None:
    w = JoinWindow(policy(capacity=3), [], T0, tolerance_percent=34.0, elastic_max_ranks=6)
    for host, devices in (("a", 2), ("b", 1)):
        assert isinstance(w.hello(hello(host, devices), T0 + 1), Admitted)
    w.tick(T0 + 2)
    w.form(T0 + 2)
    w.artifacts_shipped(T0 + 2)
    assert w.tolerance == 1
    _replay(w, ["walk c", "walk d", "enter 3", "enter 4"])
    assert w.tolerance == 1  # the world grew to five; the tolerance stays the formed world's share
