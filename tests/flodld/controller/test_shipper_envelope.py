"""`WorldShipper`'s envelopes in a grown world: a host's rank list need not be one contiguous range.

A host of the formed world that was lost and walked in again holds its lost ranks and its fresh ones
(`JoinWindow.walk_in`); the envelope shared by every host must not be built from any host's whole list
(the chaos bench's run failed with "ranks [0, 1, 10, 11] are not contiguous and ascending" when the first
host came back).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from flodld.controller.options import ControllerOptions
from flodld.controller.runparts import ShipperRun
from flodld.controller.shipper import WorldShipper
from flodld.membership.ledger import Admitted
from flodld.membership.phase import Phase
from flodld.membership.window import JoinWindow
from tests.flodld.membership.helpers import hello, policy

T0 = 1000.0


def test_the_envelope_template_holds_when_the_first_host_walked_in_again() -> None:
    w = JoinWindow(policy(capacity=3), [], T0, tolerance=2, elastic_max_ranks=4)
    for host, devices in (("a", 2), ("b", 1)):
        assert isinstance(w.hello(hello(host, devices), T0 + 1), Admitted)
    assert w.tick(T0 + 2) is Phase.FORMING
    w.form(T0 + 2)
    assert w.artifacts_shipped(T0 + 2) is Phase.TRAINING
    w.host_closed("a", T0 + 3, lost=True, why="partitioned")
    assert isinstance(w.hello(hello("c", 1), T0 + 4), Admitted)
    assert isinstance(w.hello(hello("a", 2), T0 + 5), Admitted)
    assert w.world is not None and w.world.hosts[0] == "a" and w.world.ranks["a"] == (0, 1, 4, 5)
    run = SimpleNamespace(address=("127.0.0.1", 29400), run_id="grown", options=ControllerOptions())
    template = WorldShipper(cast(ShipperRun, run))._envelope_template(w.world)
    assert template.world_size == 6 and template.run_id == "grown"
    # every host's envelope swaps in its own ranks: the walk-in's are its current (fresh) ones
    assert template.model_copy(update={"ranks": [4, 5], "local_world_size": 2}).ranks == [4, 5]
