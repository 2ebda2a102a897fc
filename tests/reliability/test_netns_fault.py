"""A network link taken down mid-run: an agent in its own network namespace behind a veth pair.

Stated bounds: the controller fails the run, naming the unreachable host, within VERDICT_BOUND_SECS of
the link going down (TCP keepalive on the join link, scaled by the run's FLODL_NET_TIMEOUT_SCALE 0.2);
the controller then shuts down as `flodld serve` does, and once the link is back the far host's agent,
relay and rank are all gone within ORPHAN_BOUND_SECS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from flodld.membership.phase import Phase
from tests.hosts import netns

from .workers import fault_options, fault_run

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]

VERDICT_BOUND_SECS = 10.0
ORPHAN_BOUND_SECS = 10.0
FORMATION_BOUND_SECS = 60.0


@pytest.fixture
def far_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side veth, host-side address) with the far end at .2 inside the namespace."""
    with netns.far_namespace("flrel", 231) as lab:
        yield lab


async def test_link_down_mid_run_fails_the_run_naming_the_host_and_leaves_no_process(
    far_namespace: tuple[str, str, str],
) -> None:
    namespace, near, near_address = far_namespace
    options = fault_options(
        bind_host="0.0.0.0",
        advertised_host=near_address,
        capacity=1,
        join=fault_options().join.model_copy(update={"target_ranks": 1, "min_rank_start": 1}),
    )
    async with fault_run(options) as run:
        agent = await run.spawn_agent(
            "far", ranks=1, wrapper=("ip", "netns", "exec", namespace), controller_host=near_address
        )
        await agent.wait_for("fault-rank 0 step 3", FORMATION_BOUND_SECS)
        netns.ip("link", "set", near, "down")
        cut_at = time.monotonic()
        try:
            result = await asyncio.wait_for(run.controller.wait(), VERDICT_BOUND_SECS)
            assert result.verdict is Phase.FAILED
            assert "far" in result.reason, result.reason
            print(f"failed {time.monotonic() - cut_at:.1f}s after the link went down: {result.reason}")
            await run.controller.close()  # as `flodld serve` does once the run has ended
        finally:
            netns.ip("link", "set", near, "up")
        took = await run.until_no_processes(ORPHAN_BOUND_SECS)
        print(f"the far host's processes were gone {took:.1f}s after the link came back")
