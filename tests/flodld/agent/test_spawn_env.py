"""What a rank's environment says about its device and its host's env (flodld.agent.spawn, pure)."""

from __future__ import annotations

import pytest

from flodld.agent.spawn import rank_environment
from flodld.wire.join import WorldEnvelope

SALT = bytes(range(16))


def envelope(env: dict[str, str] | None = None) -> WorldEnvelope:
    return WorldEnvelope.model_validate({
        "run_id": "run1", "world_size": 2, "ranks": [0, 1], "local_world_size": 2,
        "controller_host": "127.0.0.1", "controller_port": 1337, "averaging": "cpu_sync", "backend": "nccl",
        "env": env or {},
    })


def rank_env(parent: dict[str, str], device: str, **kwargs: object) -> dict[str, str]:
    return rank_environment(parent, kwargs.pop("envelope", envelope()), local_rank=0, device=device,  # type: ignore[arg-type]
                            salt=SALT, host="a", relay_port=None, fold="mean", cadence=1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("inherited", "device", "expected"),
    [
        (None, "cuda:0", "0"),
        (None, "cuda:3", "3"),
        ("2,3", "cuda:0", "2"),
        ("2,3", "cuda:1", "3"),
        (" 5 , 7 ", "cuda:1", "7"),
        ("GPU-aaaa,GPU-bbbb", "cuda:1", "GPU-bbbb"),
        ("MIG-1234", "cuda:0", "MIG-1234"),
    ],
)
def test_a_rank_sees_the_inherited_device_that_torch_numbered(
    inherited: str | None, device: str, expected: str
) -> None:
    parent = {} if inherited is None else {"CUDA_VISIBLE_DEVICES": inherited}
    env = rank_env(parent, device)
    assert env["CUDA_VISIBLE_DEVICES"] == expected


def test_an_index_outside_the_inherited_list_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cuda:2 is not among the 2 device\(s\).*'2,3'"):
        rank_env({"CUDA_VISIBLE_DEVICES": "2,3"}, "cuda:2")
    with pytest.raises(ValueError, match="0 device"):  # CUDA stops at the first empty entry
        rank_env({"CUDA_VISIBLE_DEVICES": ",1"}, "cuda:0")


def test_the_inherited_device_order_is_kept_else_pci_bus_order() -> None:
    assert rank_env({}, "cuda:0")["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    inherited = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "1,0"}
    env = rank_env(inherited, "cuda:0")
    assert (env["CUDA_DEVICE_ORDER"], env["CUDA_VISIBLE_DEVICES"]) == ("FASTEST_FIRST", "1")


def test_cpu_ranks_leave_the_visible_devices_alone() -> None:
    assert rank_env({"CUDA_VISIBLE_DEVICES": "2,3"}, "cpu:0")["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_the_host_env_overrides_the_cluster_env_but_not_the_rank_identity() -> None:
    env = rank_env(
        {"SHARED": "agent", "AGENT_ONLY": "x"},
        "cpu:0",
        envelope=envelope({"SHARED": "cluster", "CLUSTER_ONLY": "c"}),
        host_env={"SHARED": "host", "NCCL_SOCKET_IFNAME": "eth0", "RANK": "99"},
    )
    assert (env["SHARED"], env["CLUSTER_ONLY"], env["AGENT_ONLY"], env["NCCL_SOCKET_IFNAME"]) == (
        "host",
        "c",
        "x",
        "eth0",
    )
    assert env["RANK"] == "0"


def test_a_rank_gets_torchruns_rendezvous_variables_pointing_at_its_agents_loopback_store() -> None:
    # The operator's shell, the run's env and the worker's env may all carry a MASTER_ADDR: the agent's wins.
    parent = {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29500", "GROUP_RANK": "7"}
    env = rank_env(
        parent,
        "cpu:0",
        envelope=envelope({"MASTER_PORT": "1"}),
        host_env={"MASTER_ADDR": "x"},
        store_port=41234,
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "41234")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every rank is a client; rank 0 starts no server
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "0",
        "2",
        "0",
        "2",
    )
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (
        "0",
        "2",
        "0",
        "1",
    )
    assert env["TORCHELASTIC_RUN_ID"] == "run1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_without_a_store_endpoint_no_inherited_rendezvous_variable_leaks_to_a_rank() -> None:
    env = rank_env(
        {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "cpu:0"
    )
    assert not {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} & set(env)


def test_group_rank_is_left_out_when_the_host_holds_part_of_the_world_and_its_index_is_unknown() -> None:
    part = WorldEnvelope.model_validate(
        {
            "run_id": "run1",
            "world_size": 4,
            "ranks": [2, 3],
            "local_world_size": 2,
            "controller_host": "10.0.0.1",
            "controller_port": 1337,
            "averaging": "cpu_sync",
            "backend": "gloo",
            "env": {},
        }
    )
    env = rank_env({}, "cpu:0", envelope=part, store_port=5)
    assert env["RANK"] == "2" and env["ROLE_RANK"] == "2" and env["LOCAL_RANK"] == "0"
    assert "GROUP_RANK" not in env and "GROUP_WORLD_SIZE" not in env
    # ... unless the agents worked it out in the store (flodld.agent.tcpstore.node_rank).
    env = rank_env({}, "cpu:0", envelope=part, store_port=5, node=(1, 2))
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2")


def test_a_python_script_rank_starts_through_flodlds_rank_launcher_and_anything_else_as_given() -> None:
    from flodld.agent.spawn import agent_command, rank_command, relay_command

    assert rank_command(["/py", "train.py", "--lr", "1"]) == [
        "/py",
        "-m",
        "flodld.launcher.rank",
        "train.py",
        "--lr",
        "1",
    ]
    assert rank_command(["/usr/local/bin/trainer", "--lr", "1"]) == ["/usr/local/bin/trainer", "--lr", "1"]
    # Agents and relays are flodld's own processes: neither command names the user's program.
    assert agent_command("/py") == ["/py", "-m", "flodld.agent"]
    assert relay_command()[1:] == ["-m", "flodld.launcher"]
