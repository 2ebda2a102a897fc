"""ControllerOptions derived from a cluster config: bind scope, capacity, tunneled hosts."""

from __future__ import annotations

from flodld.config.builder import ClusterBuilder
from flodld.controller.options import ControllerOptions


def test_network_bind_unless_every_remote_worker_is_tunneled() -> None:
    mixed = (
        ClusterBuilder().controller("10.0.0.1", 1400).worker("localhost", ["cpu"])
        .worker("node-a", ["cpu"], path="/srv", tunnel=True).worker("node-b", ["cpu"], path="/srv").build()
    )
    options = ControllerOptions.from_cluster(mixed)
    assert options.effective_bind_host == "0.0.0.0" and options.capacity == 3 and options.port == 1400
    assert options.tunneled_hosts == frozenset({"node-a"}) and options.roster == ("localhost", "node-a", "node-b")
    tunneled = (
        ClusterBuilder().controller("10.0.0.1").worker("localhost", ["cpu"])
        .worker("node-a", ["cpu"], path="/srv", tunnel=True).build()
    )
    assert ControllerOptions.from_cluster(tunneled).effective_bind_host == "127.0.0.1"
    assert ControllerOptions.from_cluster(tunneled, bind_host="::").effective_bind_host == "::"
