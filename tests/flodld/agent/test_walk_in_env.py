"""A walk-in applies only a safe part of the controller's `env` (issue 13, point 2).

Real agents (subprocesses) join a real in-process controller whose run env tries to run code on the
worker: PYTHONPATH at a directory holding a `sitecustomize.py` that drops a marker file (Python runs it
at every interpreter start), plus LD_PRELOAD, PYTHONSTARTUP and BASH_ENV. What the rank process actually
sees is read back from its own output.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from tests.agent_proc import start_agent

from ..controller.agents import options

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).with_name("env_program.py")
REPORTED = ("LD_PRELOAD", "PYTHONSTARTUP", "BASH_ENV", "PYTHONPATH", "NCCL_DEBUG", "NCCL_NET_PLUGIN",
            "OMP_NUM_THREADS", "MYAPP_MODE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
            "GLOO_DEVICE_TRANSPORT", "GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY")  # fmt: skip


def hostile_env(evil: Path) -> dict[str, str]:
    evil.mkdir()
    marker = evil / "PWNED"
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return {
        "PYTHONPATH": str(evil), "LD_PRELOAD": str(evil / "nothing.so"), "PYTHONSTARTUP": str(evil / "x.py"),
        "BASH_ENV": str(evil / "x.sh"), "NCCL_DEBUG": "WARN",
    }  # fmt: skip


async def run_agent(
    env: dict[str, str],
    *,
    token: str | None,
    cluster_env: bool | None = None,
    accept_env: list[str] | None = None,
) -> tuple[int, str, dict[str, str | None] | None]:
    """One agent against a fresh controller whose run env is `env`: (exit code, output, what the rank saw)."""
    join = JoinConfig(discovery=True, join_timeout=60, target_ranks=1, min_rank_start=1, token=token,
                      open_admission=token is None)  # fmt: skip
    controller = Controller(options(averaging="nccl_sync", env=env, join=join))
    _, port = await controller.start()
    extra = {
        name: value for name, value in (("cluster_env", cluster_env), ("accept_env", accept_env)) if value
    }
    spec = AgentSpec(host="walker", controller_host="127.0.0.1", controller_port=port, salt_hex=token,
                     devices=["cpu"], averaging="nccl_sync", **extra)  # fmt: skip
    # The agent's own PYTHONPATH (where flodld is) stays: only the controller's values are under test.
    environ = {
        name: value for name, value in os.environ.items() if name not in REPORTED or name == "PYTHONPATH"
    }
    environ.update({"PYTHONUNBUFFERED": "1", "FLODL_TEST_REPORT_ENV": ",".join(REPORTED)})
    agent = await start_agent(PROGRAM, spec, environ)
    try:
        out, _ = await asyncio.wait_for(agent.communicate(), 120)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await controller.close()
    output = out.decode(errors="replace")
    seen = [json.loads(line.split("RANK-ENV ", 1)[1]) for line in output.splitlines() if "RANK-ENV " in line]
    assert len(seen) <= 1, output
    return agent.returncode or 0, output, seen[0] if seen else None


async def test_a_walk_in_refuses_a_controller_env_that_could_run_code(tmp_path: Path) -> None:
    evil = tmp_path / "evil"
    code, output, seen = await run_agent(hostile_env(evil), token=secrets.token_hex(16))
    assert not (evil / "PWNED").exists(), "the controller's PYTHONPATH ran code on the walk-in"
    assert seen is None, f"a rank ran with the controller's env: {seen}\n{output}"
    assert code == 2, output
    assert "REFUSING the run" in output, output
    # Every offending name is listed, the safe one is not, and the way to accept them is named.
    assert "BASH_ENV, LD_PRELOAD, PYTHONPATH, PYTHONSTARTUP for" in output, output
    assert "--accept-env BASH_ENV,LD_PRELOAD,PYTHONPATH,PYTHONSTARTUP" in output, output


async def test_safe_names_pass_and_accept_env_lets_a_named_variable_through() -> None:
    env = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "3", "MYAPP_MODE": "fast"}
    code, output, seen = await run_agent(env, token=secrets.token_hex(16), accept_env=["MYAPP_MODE"])
    assert code == 0, output
    assert seen is not None, output
    assert (seen["NCCL_DEBUG"], seen["OMP_NUM_THREADS"], seen["MYAPP_MODE"]) == ("INFO", "3", "fast")
    # Without --accept-env the same unlisted name refuses the run.
    code, output, seen = await run_agent(env, token=secrets.token_hex(16))
    assert code == 2 and seen is None, output
    assert "MYAPP_MODE" in output and "--accept-env MYAPP_MODE" in output, output


async def test_nccl_knobs_that_load_plugins_are_not_safe() -> None:
    code, output, seen = await run_agent({"NCCL_NET_PLUGIN": "evil"}, token=secrets.token_hex(16))
    assert code == 2 and seen is None, output
    assert "NCCL_NET_PLUGIN" in output


async def test_a_controller_cannot_move_a_walk_ins_traffic_or_name_its_key_files_unless_accepted() -> None:
    """Issue 29, point 5: interface, transport and TLS key-file names are the walk-in owner's call."""
    routing = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "GLOO_DEVICE_TRANSPORT": "TCP_TLS",
               "GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY": "/tmp/not-a-key.pem", "NCCL_DEBUG": "WARN"}  # fmt: skip
    code, output, seen = await run_agent(routing, token=secrets.token_hex(16))
    assert code == 2 and seen is None, output
    named = (
        "GLOO_DEVICE_TRANSPORT, GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME"
    )
    assert f"{named} for" in output and "interface or transport" in output, output
    accepted = [name for name in routing if name != "NCCL_DEBUG"]
    code, output, seen = await run_agent(routing, token=secrets.token_hex(16), accept_env=accepted)
    assert code == 0 and seen is not None, output
    assert {name: seen[name] for name in routing} == routing


async def test_under_open_admission_a_walk_in_takes_no_controller_env(tmp_path: Path) -> None:
    evil = tmp_path / "evil"
    env = {**hostile_env(evil), "MYAPP_MODE": "fast"}
    code, output, seen = await run_agent(env, token=None, accept_env=["MYAPP_MODE", "PYTHONPATH"])
    assert code == 0, output
    assert seen is not None, output
    assert not (evil / "PWNED").exists(), "the controller's PYTHONPATH ran code on the walk-in"
    for name in ("LD_PRELOAD", "PYTHONSTARTUP", "BASH_ENV", "NCCL_DEBUG", "MYAPP_MODE"):
        assert seen[name] is None, (name, seen)
    assert seen["PYTHONPATH"] == os.environ.get("PYTHONPATH"), seen
    assert "under open admission nothing authenticates the controller" in output, output


async def test_a_fan_out_agent_keeps_the_cluster_env(tmp_path: Path) -> None:
    env = {"PYTHONSTARTUP": str(tmp_path / "startup.py"), "MYAPP_MODE": "fast", "NCCL_DEBUG": "INFO"}
    code, output, seen = await run_agent(env, token=secrets.token_hex(16), cluster_env=True)
    assert code == 0, output
    assert seen is not None, output
    assert (seen["PYTHONSTARTUP"], seen["MYAPP_MODE"], seen["NCCL_DEBUG"]) == (
        env["PYTHONSTARTUP"],
        "fast",
        "INFO",
    )


def test_accept_env_comes_from_the_flag_and_the_join_block(tmp_path: Path) -> None:
    import argparse

    from fdl import join as join_command
    from fdl.progargs import reparse

    def plan(*words: str) -> AgentSpec:
        parser = argparse.ArgumentParser()
        join_command.configure_parser(parser)
        args = parser.parse_args(list(words))
        args.program_args = reparse(
            args, join_command._add_options, lambda p: p.add_argument("controller", nargs="?")
        )
        return join_command.resolve_plan(args).spec

    (tmp_path / "train.py").write_text("")
    (tmp_path / "fdl.yml").write_text(f"join:\n  address: 10.1.2.3:4000\n  program: {tmp_path / 'train.py'}\n"
                                      "  accept_env: [MYAPP_MODE, HF_HOME]\n")  # fmt: skip
    spec = plan("--project", str(tmp_path), "--accept-env", "WANDB_MODE,HF_HOME", "--accept-env", "TZ")
    assert spec.accept_env == ["MYAPP_MODE", "HF_HOME", "WANDB_MODE", "TZ"] and not spec.cluster_env
    with pytest.raises(join_command.UsageError, match="not an environment variable name"):
        plan("--project", str(tmp_path), "--accept-env", "LD_*")
    (tmp_path / "fdl.yml").write_text(
        f"join:\n  address: 10.1.2.3:4000\n  program: {tmp_path / 'train.py'}\n"
    )
    assert plan("--project", str(tmp_path)).accept_env is None
