"""ClusterBuilder produces the same validated model as the equivalent YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodld.config import ClusterBuilder, ConfigError, embedded_default, load_config

from .helpers import write

CLUSTER_YAML = """
cluster:
  controller:
    host: 192.168.1.10
    port: 1400
    path: /opt/proj
    averaging: cpu_cadence
    cadence: 5
    join:
      min_rank_start: 2
      target_ranks: 4
      start: hybrid
  workers:
    - host: node-a
      local_devices: [0, "cuda:1"]
      nccl_socket_ifname: eth0
      path: /opt/proj
      arch: precompiled/cu128
    - host: node-b
      ssh:
        target: b.lan
        port: 2222
        user: ubuntu
        options: [ProxyJump=bastion]
      tunnel: true
      local_devices: all
      nccl_socket_ifname: enp1s0
      path: /srv/proj
      env:
        OMP_NUM_THREADS: "2"
  env:
    NCCL_DEBUG: INFO
"""


def test_builder_equals_loaded_yaml(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", CLUSTER_YAML)
    loaded = load_config(tmp_path).cluster
    built = (
        ClusterBuilder()
        .controller("192.168.1.10", 1400, path="/opt/proj", averaging="cpu_cadence", cadence=5)
        .join(min_rank_start=2, target_ranks=4)
        .join(start="hybrid")
        .worker(
            "node-a", devices=[0, 1], nccl_socket_ifname="eth0", path="/opt/proj", arch="precompiled/cu128"
        )
        .worker(
            "node-b",
            devices="all",
            ssh={"target": "b.lan", "port": 2222, "user": "ubuntu", "options": ["ProxyJump=bastion"]},
            tunnel=True,
            nccl_socket_ifname="enp1s0",
            path="/srv/proj",
            env={"OMP_NUM_THREADS": "2"},
        )
        .env(NCCL_DEBUG="INFO")
        .build()
    )
    assert built == loaded


def test_builder_data_round_trips_through_yaml(tmp_path: Path) -> None:
    from ruamel.yaml import YAML

    builder = ClusterBuilder().controller("127.0.0.1", 0).worker("127.0.0.1", devices=["cpu:3"]).env(X="y")
    with (tmp_path / "fdl.yml").open("w") as handle:
        YAML(typ="safe").dump({"cluster": builder.as_data()}, handle)
    assert load_config(tmp_path).cluster == builder.build()


def test_builder_errors_name_key_paths_without_a_file() -> None:
    builder = (
        ClusterBuilder().controller("10.0.0.1", averaging="bogus").worker("a", devices=["gpu"], colour="red")
    )
    with pytest.raises(ConfigError) as caught:
        builder.build()
    rendered = {str(issue) for issue in caught.value.issues}
    assert any(text.startswith("controller.averaging: Input should be") for text in rendered)
    assert any(text.startswith("workers[0].local_devices[0]: 'gpu' is not a device") for text in rendered)
    assert any(text.startswith("workers[0].colour: unknown key 'colour'") for text in rendered)
    assert all(issue.file is None for issue in caught.value.issues)


def test_build_without_controller_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"call \.controller\(host, port\)"):
        ClusterBuilder().worker("a", devices=[0]).build()


def test_embedded_default_is_local_cpu_gloo_with_a_free_port() -> None:
    cluster = embedded_default()
    assert cluster.controller.host == "127.0.0.1" and cluster.controller.port == 0
    assert cluster.controller.averaging.value == "cpu_sync" and cluster.controller.backend.value == "gloo"
    assert len(cluster.workers) == 1 and cluster.workers[0].is_local(cluster.controller.host)
    assert cluster.capacity() == 2
    assert cluster.workers[0].device_labels() == ["cpu:0", "cpu:1"]
    assert embedded_default(5).capacity() == 5


@pytest.mark.parametrize("ranks", [0, -1, True, 2.0])
def test_embedded_default_refuses_bad_rank_counts(ranks: object) -> None:
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        embedded_default(ranks)  # type: ignore[arg-type]  # bad input on purpose
