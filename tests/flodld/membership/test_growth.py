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


def test_no_bound_keeps_the_window_closed_after_formation() -> None:
    w = training(bound=None)
    refused = w.hello(hello("c", 1), T0 + 5)
    assert isinstance(refused, Refused) and refused.code == "window_closed"
    assert w.world is not None and w.world.world_size == 3
