"""Every cross-key rule of `cluster:`, checked through ClusterBuilder (which runs the model's rules)."""

from __future__ import annotations

from typing import Any

import pytest

from flodld.config import ClusterBuilder, ClusterConfig, ConfigError, format_key_path


def two_hosts(**controller: object) -> ClusterBuilder:
    return (
        ClusterBuilder()
        .controller("10.0.0.1", 1337, **controller)
        .worker("node-a", devices=[0], path="/p", nccl_socket_ifname="eth0")
        .worker("node-b", devices=[0, 1], path="/p", nccl_socket_ifname="eth0")
    )


def failures(builder: ClusterBuilder) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        builder.build()
    return {format_key_path(issue.key_path): issue.message for issue in caught.value.issues}


def test_a_valid_two_host_cluster_builds() -> None:
    cluster = two_hosts().build()
    assert isinstance(cluster, ClusterConfig)
    assert [worker.host for worker in cluster.workers] == ["node-a", "node-b"]


def test_workers_must_not_be_empty_without_discovery() -> None:
    found = failures(ClusterBuilder().controller("10.0.0.1"))
    assert "discovery: true" in found["workers"]


def test_an_empty_roster_is_fine_under_discovery() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .join(discovery=True, min_rank_start=2, token="ab" * 16)
        .build()
    )
    assert cluster.workers == ()
    assert cluster.capacity() == 0


def test_discovery_on_a_network_bind_without_a_way_in_is_refused_naming_the_three_ways_out() -> None:
    found = failures(ClusterBuilder().controller("10.0.0.1").join(discovery=True, min_rank_start=2))
    message = found["controller.join.discovery"]
    assert "can never admit a walk-in" in message and "bad_tag" in message
    for way_out in ("controller.join.token", "FDL_JOIN_TOKEN", "open_admission: true", "tunnel_only: true"):
        assert way_out in message


@pytest.mark.parametrize(
    "way_in",
    [{"token": "ab" * 16}, {"open_admission": True}, {"tunnel_only": True}],
    ids=["token", "open_admission", "tunnel_only"],
)
def test_discovery_with_a_way_in_loads(way_in: dict[str, Any]) -> None:
    cluster = ClusterBuilder().controller("10.0.0.1").join(discovery=True, min_rank_start=2, **way_in).build()
    assert cluster.controller.join.discovery


def test_discovery_behind_an_all_tunneled_roster_binds_loopback_and_loads() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .join(discovery=True, min_rank_start=1)
        .worker("node-a", devices=["cpu"], path="/srv/p", tunnel=True)
        .build()
    )
    assert cluster.controller.join.token is None


def test_duplicate_worker_hosts_are_errors() -> None:
    builder = two_hosts().worker("node-a", devices=[1], path="/p", nccl_socket_ifname="eth0")
    found = failures(builder)
    assert "already workers[0]" in found["workers[2].host"]


def test_remote_worker_needs_a_path_but_a_local_one_does_not() -> None:
    found = failures(ClusterBuilder().controller("10.0.0.1").worker("node-a", devices=[0]))
    assert "path" in found["workers[0].path"]
    local = ClusterBuilder().controller("10.0.0.1").worker("localhost", devices=["cpu"]).build()
    assert local.workers[0].path is None
    same_host = ClusterBuilder().controller("10.0.0.1").worker("10.0.0.1", devices=["cpu"]).build()
    assert same_host.workers[0].is_local("10.0.0.1")


def test_nccl_averaging_requires_the_nccl_backend() -> None:
    found = failures(two_hosts(averaging="nccl_sync", backend="gloo"))
    assert "backend: nccl" in found["controller.averaging"]
    assert two_hosts(averaging="nccl_sync", backend="nccl").build().controller.averaging.is_cpu is False


def test_cadence_on_a_sync_mode_is_an_error_and_defaults_follow_the_mode() -> None:
    found = failures(two_hosts(averaging="cpu_sync", cadence=5))
    assert "no effect" in found["controller.cadence"]
    assert two_hosts(averaging="cpu_sync", cadence=1).build().controller.effective_cadence == 1
    assert two_hosts(averaging="cpu_cadence").build().controller.effective_cadence == 10
    assert two_hosts(averaging="cpu_async", cadence=4).build().controller.effective_cadence == 4


def test_nccl_backend_refuses_cpu_ranks() -> None:
    builder = ClusterBuilder().controller("10.0.0.1", backend="nccl").worker("localhost", devices=[0, "cpu"])
    assert "CPU ranks" in failures(builder)["workers[0].local_devices"]


def test_multi_host_nccl_needs_nccl_socket_ifname_on_every_worker() -> None:
    builder = (
        ClusterBuilder()
        .controller("10.0.0.1", backend="nccl")
        .worker("node-a", devices=[0], path="/p", nccl_socket_ifname="eth0")
        .worker("node-b", devices=[0], path="/p")
    )
    found = failures(builder)
    assert list(found) == ["workers[1].nccl_socket_ifname"]
    assert "spans several hosts" in found["workers[1].nccl_socket_ifname"]


def test_nccl_socket_ifname_is_optional_for_one_host_or_for_gloo() -> None:
    ClusterBuilder().controller("10.0.0.1", backend="nccl").worker("node-a", devices=[0], path="/p").build()
    (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("node-a", devices=["cpu"], path="/p")
        .worker("node-b", devices=["cpu"], path="/p")
        .build()
    )


def test_port_zero_only_when_every_worker_is_local() -> None:
    ClusterBuilder().controller("127.0.0.1", 0).worker("127.0.0.1", devices=["cpu:2"]).build()
    found = failures(ClusterBuilder().controller("127.0.0.1", 0).worker("node-a", devices=["cpu"], path="/p"))
    assert "node-a" in found["controller.port"]
    found = failures(ClusterBuilder().controller("127.0.0.1", 0).join(discovery=True, min_rank_start=1))
    assert "discovery" in found["controller.port"]


@pytest.mark.parametrize("port", [-1, 65536, "1337", 1.5, True])
def test_controller_port_must_be_an_integer_in_range(port: object) -> None:
    builder = ClusterBuilder().controller("127.0.0.1", port).worker("127.0.0.1", devices=["cpu"])  # type: ignore[arg-type]  # bad input on purpose
    assert "controller.port" in failures(builder)


@pytest.mark.parametrize("port", [0, 65536, "22"])
def test_ssh_port_must_be_an_integer_from_1_to_65535(port: object) -> None:
    builder = (
        ClusterBuilder().controller("10.0.0.1").worker("node-a", devices=[0], path="/p", ssh={"port": port})
    )
    assert "workers[0].ssh.port" in failures(builder)


def test_tunnel_on_a_remote_worker_with_cpu_averaging_is_fine() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="cpu_async")
        .worker("node-a", devices=[0], path="/p", tunnel=True)
        .build()
    )
    assert cluster.workers[0].tunnel


def test_tunnel_on_the_controller_host_is_an_error() -> None:
    builder = ClusterBuilder().controller("10.0.0.1").worker("localhost", devices=["cpu"], tunnel=True)
    assert "controller host" in failures(builder)["workers[0].tunnel"]


def test_tunnel_needs_cpu_averaging_and_a_gloo_group() -> None:
    nccl_mode = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="nccl_cadence", backend="nccl")
        .worker("node-a", devices=[0], path="/p", tunnel=True)
    )
    assert "CPU averaging mode" in failures(nccl_mode)["workers[0].tunnel"]
    nccl_group = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="cpu_sync", backend="nccl")
        .worker("node-a", devices=[0], path="/p", tunnel=True)
    )
    assert "backend: gloo" in failures(nccl_group)["workers[0].tunnel"]


def test_tunnel_only_requires_tunnels_on_remote_workers_and_cpu_averaging() -> None:
    builder = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .join(tunnel_only=True, discovery=True, min_rank_start=1)
        .worker("localhost", devices=["cpu"])
        .worker("node-a", devices=["cpu"], path="/p")
    )
    assert list(failures(builder)) == ["workers[1].tunnel"]
    nccl = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="nccl_sync", backend="nccl")
        .join(tunnel_only=True, discovery=True, min_rank_start=1)
    )
    assert "controller.join.tunnel_only" in failures(nccl)


def test_reserved_and_malformed_env_keys_are_refused_at_both_scopes() -> None:
    builder = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("node-a", devices=[0], path="/p", env={"FLODL_INTERNAL_X": "1", "OK_KEY": "v"})
        .env(RANK="3")
    )
    found = failures(builder)
    assert "reserved" in found["workers[0].env.FLODL_INTERNAL_X"]
    assert "reserved" in found["env.RANK"]
    bad_name = (
        ClusterBuilder().controller("10.0.0.1").worker("node-a", devices=[0], path="/p", env={"1BAD": "x"})
    )
    assert "not a valid environment variable name" in failures(bad_name)["workers[0].env.1BAD"]


def test_capacity_sums_explicit_devices_and_needs_probes_for_all() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("node-a", devices=[0, "cpu:3"], path="/p", nccl_socket_ifname="eth0")
        .worker("node-b", devices="all", path="/p", nccl_socket_ifname="eth0")
        .build()
    )
    assert cluster.explicit_capacity == 4
    assert cluster.hosts_to_probe == ("node-b",)
    assert cluster.workers[1].rank_count is None
    assert cluster.workers[0].device_labels() == ["cuda:0", "cpu:0", "cpu:1", "cpu:2"]
    assert cluster.capacity({"node-b": 8}) == 12
    with pytest.raises(ValueError, match="node-b"):
        cluster.capacity()


def test_ssh_target_defaults_to_the_worker_host() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("node-a", devices=[0], path="/p", nccl_socket_ifname="eth0")
        .worker(
            "node-b", devices=[0], path="/p", nccl_socket_ifname="eth0", ssh={"target": "b.lan", "user": "me"}
        )
        .build()
    )
    assert [worker.ssh_target for worker in cluster.workers] == ["node-a", "b.lan"]
    assert cluster.worker("node-b") is cluster.workers[1]
    assert cluster.worker("nope") is None


@pytest.mark.parametrize("key", ["docker", "arch"])
def test_controller_docker_and_arch_are_refused_as_not_implemented(key: str) -> None:
    setting: dict[str, Any] = {key: "cuda"}  # a YAML-shaped `controller:` setting
    found = failures(ClusterBuilder().controller("10.0.0.1", **setting).worker("127.0.0.1", devices=["cpu"]))
    assert (
        "not implemented" in found[f"controller.{key}"] and f"workers[].{key}" in found[f"controller.{key}"]
    )


def test_controller_docker_is_refused_in_yaml_at_its_line() -> None:
    from flodld.config import load_text

    text = ("cluster:\n  controller:\n    host: 10.0.0.1\n    docker: build\n"
            "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu]}\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^fdl\.yml:4:5: cluster\.controller\.docker: .*not implemented"):
        load_text(text)
