from __future__ import annotations

import os
from pathlib import Path

import pytest

from flodld.agent.join import rewrite_controller_address
from flodld.agent.spawn import program_argv, rank_environment, relay_environment
from flodld.agent.spec import (
    AGENT_ENV,
    AgentSpec,
    DeviceError,
    SpecError,
    decode_agent_spec,
    encode_spec,
    parse_device_list,
    resolve_devices,
)
from flodld.launcher import Role, RoleError, current_role
from flodld.rank.env import RankEnvError, read_rank_environment
from flodld.relay.spec import RELAY_ENV, RelayRoleSpec
from flodld.wire.join import RelaySpec, WorldEnvelope, WorldFormed

SALT = bytes(range(16))


def envelope(**overrides: object) -> WorldEnvelope:
    values: dict[str, object] = {
        "run_id": "run1", "world_size": 4, "ranks": [2, 3], "local_world_size": 2,
        "controller_host": "10.0.0.1", "controller_port": 1337, "averaging": "cpu_sync", "backend": "gloo",
        "env": {"EXTRA": "1"},
    }
    values.update(overrides)
    return WorldEnvelope.model_validate(values)


def test_agent_spec_round_trips_through_hex_and_omits_unset_fields() -> None:
    spec = AgentSpec(
        host="h", controller_host="127.0.0.1", controller_port=9, salt_hex="ab" * 16, devices=["cpu:2"]
    )
    text = encode_spec(spec)
    assert bytes.fromhex(text).decode() == (
        '{"host":"h","controller_host":"127.0.0.1","controller_port":9,"salt_hex":"'
        + "ab" * 16
        + '","devices":["cpu:2"],"grace_secs":5.0}'
    )
    assert decode_agent_spec(text) == spec
    minimal = b'{"host":"h","controller_host":"c","controller_port":1}'.hex()
    assert decode_agent_spec(minimal).salt_hex is None


def test_agent_spec_errors_name_the_variable() -> None:
    with pytest.raises(SpecError, match=f"{AGENT_ENV} is not valid hex"):
        decode_agent_spec("zz")
    with pytest.raises(SpecError, match="invalid JSON"):
        decode_agent_spec(b"{not json".hex())


def test_devices_resolve_to_one_indexed_device_per_rank() -> None:
    assert resolve_devices(parse_device_list("cpu:3"), cuda_count=0) == ["cpu:0", "cpu:1", "cpu:2"]
    assert resolve_devices(["cpu", "cpu"], cuda_count=0) == ["cpu:0", "cpu:1"]
    assert resolve_devices(["0", "cuda:2"], cuda_count=4) == ["cuda:0", "cuda:2"]
    assert resolve_devices(None, cuda_count=2) == ["cuda:0", "cuda:1"]
    assert resolve_devices(None, cuda_count=0) == ["cpu:0"]
    with pytest.raises(DeviceError, match="found no CUDA device"):
        resolve_devices(["all"], cuda_count=0)
    with pytest.raises(DeviceError, match="has 1 CUDA device"):
        resolve_devices(["3"], cuda_count=1)
    with pytest.raises(DeviceError, match="more than once"):
        resolve_devices(["0", "cuda:0"], cuda_count=1)
    with pytest.raises(DeviceError, match="not understood"):
        resolve_devices(["tpu"], cuda_count=0)


def test_rank_environment_is_torchrun_shaped_and_carries_the_salt_only_in_the_environment() -> None:
    parent = {"PATH": "/bin", AGENT_ENV: "secret-spec", RELAY_ENV: "x", "OMP_NUM_THREADS": "1"}
    env = rank_environment(
        parent,
        envelope(),
        local_rank=1,
        device="cpu:1",
        salt=SALT,
        host="b",
        relay_port=4000,
        fold="mean",
        cadence=1,
    )
    assert AGENT_ENV not in env and RELAY_ENV not in env
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "2",
    )
    assert env["FLODL_CONTROLLER"] == "10.0.0.1:1337" and env["EXTRA"] == "1"
    parsed = read_rank_environment(env)
    assert parsed.salt == SALT and parsed.relay_port == 4000 and parsed.rank == 3
    assert SALT.hex() not in " ".join(program_argv())
    cuda = rank_environment(
        parent,
        envelope(),
        local_rank=0,
        device="cuda:5",
        salt=SALT,
        host="b",
        relay_port=None,
        fold="mean",
        cadence=1,
    )
    assert cuda["CUDA_VISIBLE_DEVICES"] == "5" and "FLODL_RELAY_PORT" not in cuda


def test_rank_environment_errors_name_the_variable() -> None:
    with pytest.raises(RankEnvError, match="FLODL_CONTROLLER='nope' is not HOST:PORT"):
        read_rank_environment({"RANK": "0", "WORLD_SIZE": "1", "FLODL_CONTROLLER": "nope"})
    with pytest.raises(RankEnvError, match="RANK=2 does not fit WORLD_SIZE=2"):
        read_rank_environment({"RANK": "2", "WORLD_SIZE": "2", "FLODL_CONTROLLER": "h:1"})


def test_relay_environment_has_only_the_relay_role() -> None:
    spec = RelayRoleSpec(
        host="b",
        controller_host="h",
        controller_port=5,
        salt_hex=SALT.hex(),
        host_key_hex=SALT.hex(),
        ranks=[2],
        listen_fd=7,
    )
    env = relay_environment({AGENT_ENV: "x", "RANK": "1", "FLODL_CONTROLLER": "h:5"}, spec)
    assert set(env) == {RELAY_ENV, "OMP_NUM_THREADS"}
    assert current_role(env) is Role.RELAY
    # The fold shares the host's cores with its CPU ranks: their thread count (the fork server's too).
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // len(spec.ranks)))
    assert relay_environment({"OMP_NUM_THREADS": "3"}, spec)["OMP_NUM_THREADS"] == "3"


def test_role_dispatch_refuses_two_roles_at_once() -> None:
    assert current_role({}) is Role.PLAIN
    assert current_role({AGENT_ENV: "x"}) is Role.AGENT
    assert current_role({"RANK": "0", "FLODL_CONTROLLER": "h:1"}) is Role.RANK
    with pytest.raises(RoleError, match="inconsistent role environment"):
        current_role({AGENT_ENV: "x", RELAY_ENV: "y"})


def test_address_rewrite_replaces_the_controller_in_envelope_and_relay_only() -> None:
    formed = WorldFormed(
        envelope=envelope(), relay=RelaySpec(data_port=1337, control_port=1337, fold="mean", cadence=1)
    )
    rewritten = rewrite_controller_address(formed, "127.0.0.1", 40123)
    assert (rewritten.envelope.controller_host, rewritten.envelope.controller_port) == ("127.0.0.1", 40123)
    assert rewritten.relay is not None and (rewritten.relay.data_port, rewritten.relay.control_port) == (
        40123,
        40123,
    )
    assert rewritten.envelope.model_dump(
        exclude={"controller_host", "controller_port"}
    ) == formed.envelope.model_dump(exclude={"controller_host", "controller_port"})


def test_a_spec_announced_as_coming_on_stdin_is_read_from_one_line_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fdl run` starts its agents before its controller listens (their imports overlap its start) and
    writes each spec, salt included, on the agent's stdin: the salt never sits in the agent's environment.
    """
    import io

    from flodld.agent.spec import SPEC_ON_STDIN, agent_spec_from_env

    spec = AgentSpec(host="h", controller_host="127.0.0.1", controller_port=1, salt_hex="ab" * 16)
    monkeypatch.setenv(AGENT_ENV, SPEC_ON_STDIN)
    assert agent_spec_from_env(io.StringIO(encode_spec(spec) + "\n")) == spec
    with pytest.raises(SpecError, match="stdin ended before the spec line did"):
        agent_spec_from_env(io.StringIO(encode_spec(spec)))  # the launcher died mid-line
    with pytest.raises(SpecError, match="stdin ended"):
        agent_spec_from_env(io.StringIO(""))
    with pytest.raises(SpecError, match="over 1048576 bytes"):
        agent_spec_from_env(io.StringIO("a" * (2 << 20) + "\n"))


AGENT_PID = """
def agent_pid():
    # The agent: the rank's parent, or (a rank forked by fdl run's fork server) whoever reads its stdout.
    parent = os.getppid()
    if b'--fork-server' not in open(f'/proc/{parent}/cmdline', 'rb').read():
        return parent
    pipe = os.readlink('/proc/self/fd/1')
    for pid in (p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()):
        try:
            if any(os.readlink(f'/proc/{pid}/fd/{fd}') == pipe for fd in os.listdir(f'/proc/{pid}/fd')):
                return int(pid)
        except OSError:
            continue
    raise RuntimeError('no process reads this rank stdout')
"""


def test_fdl_runs_agent_has_no_salt_in_its_environment(tmp_path: Path) -> None:
    """Under `fdl run` the agent's /proc/PID/environ (readable by the same user, inherited by nothing
    of flodld's but visible) carries the role marker, not the spec and its salt.
    """
    import subprocess
    import sys

    program = tmp_path / "peek.py"
    program.write_text(
        "import os, sys\n"
        "import flodld\n"
        "from flodld.rank.env import read_rank_environment\n"
        + AGENT_PID
        + "def main():\n"
        "    salt = read_rank_environment().salt.hex()\n"
        "    environ = open(f'/proc/{agent_pid()}/environ', 'rb').read().decode(errors='replace')\n"
        "    spec = dict(v.split('=', 1) for v in environ.split('\\0') if '=' in "
        "v).get('FLODL_INTERNAL_AGENT_JSON')\n"
        "    marker = spec == '-'\n"
        "    environ += bytes.fromhex(spec).decode() if spec and spec != '-' else ''\n"
        "    print('agent-env', 'salt-present' if salt in environ else 'no-salt', 'marker' if marker else "
        "'nomarker',"
        " flush=True)\n"
        "    return 0\n"
        "sys.exit(flodld.run(main, init_process_group=False))\n"
    )
    fdl = Path(sys.executable).with_name("fdl")
    done = subprocess.run([str(fdl), "run", "--ranks", "1", str(program)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "agent-env no-salt marker" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
