"""An agent whose controller's network vanishes (no FIN, no RST) tears its host down and exits non-zero.

The agent runs in its own network namespace behind a veth pair; the link is taken down and stays down, so
only the agent's own liveness (TCP keepalive on the join link) can tell it the controller is gone. Its rank
never speaks to the controller (no CPU averaging, no relay), so nothing else would end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from flodld.net.keepalive import LINK_KEEPALIVE_SECS
from tests.agent_proc import start_agent
from tests.hosts import netns

from ..controller.agents import options

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]

PROGRAM = Path(__file__).with_name("silent_program.py")
SCALE = 0.2
GRACE_SECS = 1.0
# keepalive idle + 3 probes at idle/3 = 2 * idle (3 s at scale 0.2), the grace period, and slack for 2 busy
# cores
EXIT_BOUND_SECS = 2 * LINK_KEEPALIVE_SECS * SCALE + GRACE_SECS + 6.0


@pytest.fixture
def far_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side veth, host-side address); the far end is .2 inside the namespace."""
    with netns.far_namespace("fldag", 232) as lab:
        yield lab


async def _collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    async for line in stream:
        lines.append(line.decode(errors="replace"))


async def _wait_for(lines: list[str], fragment: str, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not any(fragment in line for line in lines):
            await asyncio.sleep(0.05)


async def test_an_agent_cut_off_from_its_controller_tears_down_and_exits_non_zero(
    far_namespace: tuple[str, str, str],
) -> None:
    namespace, near, near_address = far_namespace
    controller = Controller(
        options(
            bind_host="0.0.0.0",
            advertised_host=near_address,
            capacity=1,
            averaging="nccl_sync",
            link_keepalive_secs=600.0,  # the controller must not end the link first: this is the agent's test
            join=JoinConfig(join_timeout=60, target_ranks=1, min_rank_start=1),
        )
    )
    _, port = await controller.start()
    spec = AgentSpec(
        host="far",
        controller_host=near_address,
        controller_port=port,
        salt_hex=controller.salt_hex,
        devices=["cpu"],
        averaging="nccl_sync",
        grace_secs=GRACE_SECS,
    )
    env = {**os.environ, "FLODL_NET_TIMEOUT_SCALE": str(SCALE), "PYTHONUNBUFFERED": "1"}
    agent = await start_agent(PROGRAM, spec, env, "ip", "netns", "exec", namespace, new_session=True)
    lines: list[str] = []
    assert agent.stdout is not None
    collector = asyncio.ensure_future(_collect(agent.stdout, lines))
    try:
        await _wait_for(lines, "silent-rank ready", 60)
        netns.ip("link", "set", near, "down")
        cut_at = time.monotonic()
        code = await asyncio.wait_for(agent.wait(), EXIT_BOUND_SECS)
        took = time.monotonic() - cut_at
        await asyncio.wait_for(collector, 5)
        output = "".join(lines)
        assert code == 1, output
        assert "controller link lost" in output, output
        assert "silent-rank outlived" not in output
        print(f"agent exited {code} {took:.1f}s after its controller's network vanished")
    finally:
        if agent.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, 9)
            await agent.wait()
        collector.cancel()
        await controller.close()
