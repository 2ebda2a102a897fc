"""ControllerOptions derived from a cluster config: bind scope, capacity, tunneled hosts."""

from __future__ import annotations

import pytest

from flodld.config.builder import ClusterBuilder
from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.membership.policy import PolicyError, derive_policy


def test_network_bind_unless_every_remote_worker_is_tunneled() -> None:
    mixed = (
        ClusterBuilder().controller("10.0.0.1", 1400).worker("localhost", ["cpu"])
        .worker("node-a", ["cpu"], path="/srv", tunnel=True).worker("node-b", ["cpu"], path="/srv").build()
    )
    options = ControllerOptions.from_cluster(mixed)
    assert options.effective_bind_host == "0.0.0.0" and options.capacity == 3 and options.port == 1400
    assert options.tunneled_hosts == frozenset({"node-a"}) and options.roster == (
        "localhost",
        "node-a",
        "node-b",
    )
    tunneled = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("localhost", ["cpu"])
        .worker("node-a", ["cpu"], path="/srv", tunnel=True)
        .build()
    )
    assert ControllerOptions.from_cluster(tunneled).effective_bind_host == "127.0.0.1"
    assert ControllerOptions.from_cluster(tunneled, bind_host="::").effective_bind_host == "::"


def test_the_roster_declares_each_workers_rank_count_and_probed_all_workers_theirs() -> None:
    cluster = (
        ClusterBuilder().controller("10.0.0.1").worker("node-a", [0], path="/srv")
        .worker("node-b", "all", path="/srv").worker("node-c", ["cpu:3"], path="/srv").build()
    )  # fmt: skip
    assert ControllerOptions.from_cluster(cluster, probed={"node-b": 4}).declared_ranks == {
        "node-a": 1, "node-b": 4, "node-c": 3,
    }  # fmt: skip


def test_serve_flags_override_their_options_and_unset_flags_leave_defaults() -> None:
    import argparse

    from flodld.controller.daemon import add_serve_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = options_from_args(
        parser.parse_args(
            [
                "--host",
                "10.0.0.5",
                "--port",
                "1400",
                "--bind",
                "127.0.0.1",
                "--ranks",
                "6",
                "--averaging",
                "cpu_sync",
                "--run-id",
                "r1",
                "--tolerance",
                "2",
                "--target",
                "6",
                "--window",
                "30",
            ]
        )
    )
    assert (given.advertised_host, given.port, given.bind_host, given.capacity) == (
        "10.0.0.5",
        1400,
        "127.0.0.1",
        6,
    )
    assert (given.averaging, given.run_id, given.tolerance) == ("cpu_sync", "r1", 2)
    assert (given.join.target_ranks, given.join.join_timeout) == (6, 30.0)
    defaults = options_from_args(parser.parse_args([]))
    assert defaults.tolerance == 0 and defaults.join.target_ranks is None and defaults.run_id != "r1"
    assert defaults.straggler_timeout is None
    late = ["--averaging", "cpu_cadence", "--straggler-timeout", "2.5"]
    assert options_from_args(parser.parse_args(late)).straggler_timeout == 2.5
    with pytest.raises(ValueError, match="straggler_timeout applies to cpu_cadence and cpu_async"):
        options_from_args(parser.parse_args(["--straggler-timeout", "2.5"]))


def test_averaging_is_the_config_enum_from_the_cli_choices_to_the_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from flodld.controller.daemon import add_serve_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = options_from_args(parser.parse_args(["--averaging", "nccl_sync"]))
    assert given.averaging is AveragingMode.NCCL_SYNC and not given.cpu_averaging
    assert ControllerOptions(averaging="cpu_cadence").averaging is AveragingMode.CPU_CADENCE
    cluster = (
        ClusterBuilder().controller("10.0.0.1", averaging="cpu_async").worker("localhost", ["cpu"]).build()
    )
    assert ControllerOptions.from_cluster(cluster).averaging is AveragingMode.CPU_ASYNC
    with pytest.raises(
        SystemExit
    ) as refused:  # an unknown mode stops at the command line, naming the choices
        parser.parse_args(["--averaging", "cpu_fast"])
    assert refused.value.code == 2
    usage = capsys.readouterr().err
    assert all(mode.value in usage for mode in AveragingMode)
    with pytest.raises(
        PolicyError, match=r"cpu_sync / cpu_cadence / cpu_async\), but averaging is 'nccl_sync'"
    ):
        derive_policy(
            JoinConfig(discovery=True, tunnel_only=True, min_rank_start=1),
            capacity=0,
            loopback_bind=True,
            averaging=AveragingMode.NCCL_SYNC,
        )


@pytest.mark.parametrize(
    ("written", "count", "percent"), [(2, 2, None), ("25%", 0, 25.0), ("12.5%", 0, 12.5)]
)
def test_the_tolerance_is_a_count_or_a_share_of_the_world(
    written: int | str, count: int, percent: float | None
) -> None:
    cluster = ClusterBuilder().controller("10.0.0.1", tolerance=written).worker("localhost", ["cpu"]).build()
    options = ControllerOptions.from_cluster(cluster)
    assert (options.tolerance, options.tolerance_percent) == (count, percent)


@pytest.mark.parametrize("written", ["150%", "-1", "a%", -1, "5"])
def test_a_tolerance_that_is_neither_a_count_nor_a_percentage_is_refused(written: int | str) -> None:
    with pytest.raises(ValueError, match="tolerance"):
        ClusterBuilder().controller("10.0.0.1", tolerance=written).worker("localhost", ["cpu"]).build()


def test_a_straggler_timeout_is_for_cadence_and_async_rounds_and_reaches_the_options() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", averaging="cpu_cadence", straggler_timeout=2.5)
        .worker("localhost", ["cpu"])
        .build()
    )
    assert ControllerOptions.from_cluster(cluster).straggler_timeout == 2.5
    with pytest.raises(ValueError, match="applies to cpu_cadence and cpu_async, not cpu_sync"):
        ClusterBuilder().controller("10.0.0.1", straggler_timeout=2.5).worker("localhost", ["cpu"]).build()
    with pytest.raises(ValueError, match="straggler_timeout"):
        ControllerOptions.model_validate({"averaging": "cpu_sync", "straggler_timeout": 1.0})
    asynchronous = ControllerOptions.model_validate({"averaging": "cpu_async", "straggler_timeout": 1.0})
    assert asynchronous.straggler_timeout == 1.0
