"""The agent's formed mark: the file `fdl join --persist` reads to reset its back-off after a run that formed.

A real agent (a subprocess) joins a real in-process controller; the mark holds the run id once the world
formed, and stays absent when the join never got that far.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path

import pytest

from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from tests.agent_proc import start_agent

from ..controller.agents import options

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).with_name("env_program.py")  # a rank that reports and exits


async def _agent_exit(spec: AgentSpec) -> tuple[int, str]:
    agent = await start_agent(PROGRAM, spec, {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = await asyncio.wait_for(agent.communicate(), 120)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    return agent.returncode or 0, out.decode(errors="replace")


async def test_the_agent_writes_the_run_id_to_its_formed_mark_once_the_world_formed(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    join = JoinConfig(discovery=True, join_timeout=60, target_ranks=1, min_rank_start=1, token=token)
    controller = Controller(options(averaging="nccl_sync", join=join))
    _, port = await controller.start()
    mark = tmp_path / "formed"
    spec = AgentSpec(host="walker", controller_host="127.0.0.1", controller_port=port, salt_hex=token,
                     devices=["cpu"], averaging="nccl_sync", formed_file=str(mark))  # fmt: skip
    try:
        code, output = await _agent_exit(spec)
    finally:
        await controller.close()
    assert code == 0, output
    assert mark.read_text() == f"{controller.run_id}\n"


async def test_no_formed_mark_when_the_join_never_formed_a_world(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens here once the socket is closed
    mark = tmp_path / "formed"
    spec = AgentSpec(host="walker", controller_host="127.0.0.1", controller_port=port, devices=["cpu"],
                     connect_attempts=1, formed_file=str(mark))  # fmt: skip
    code, output = await _agent_exit(spec)
    assert code == 1, output
    assert not mark.exists()
