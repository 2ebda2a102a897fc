"""A network link taken down mid-run: an agent in its own network namespace behind a veth pair.

Stated bounds: the controller fails the run, naming the unreachable host, within VERDICT_BOUND_SECS of
the link going down (TCP keepalive on the join link, scaled by the run's FLODL_NET_TIMEOUT_SCALE 0.2);
the controller then shuts down as `flodld serve` does, and once the link is back the far host's agent,
relay and rank are all gone within ORPHAN_BOUND_SECS.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from flodld.membership.phase import Phase

from .workers import fault_options, fault_run

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]

VERDICT_BOUND_SECS = 10.0
ORPHAN_BOUND_SECS = 10.0
FORMATION_BOUND_SECS = 60.0


def _ip(*words: str) -> None:
    subprocess.run(["ip", *words], check=True, capture_output=True, timeout=10)


@pytest.fixture
def far_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side veth, host-side address) with the far end at .2 inside the namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (netns marker)")
    tag = f"{os.getpid() % 100000}"
    namespace, near, far = f"flrel{tag}", f"vrn{tag}", f"vrf{tag}"
    third = os.getpid() % 200 + 20
    near_address, far_address = f"10.231.{third}.1", f"10.231.{third}.2"
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", namespace)
        _ip("addr", "add", f"{near_address}/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("netns", "exec", namespace, "ip", "addr", "add", f"{far_address}/30", "dev", far)
        _ip("netns", "exec", namespace, "ip", "link", "set", far, "up")
        _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield namespace, near, near_address
    finally:
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)


async def test_link_down_mid_run_fails_the_run_naming_the_host_and_leaves_no_process(
    far_namespace: tuple[str, str, str],
) -> None:
    namespace, near, near_address = far_namespace
    options = fault_options(bind_host="0.0.0.0", advertised_host=near_address, capacity=1,
                            join=fault_options().join.model_copy(update={"target_ranks": 1, "min_rank_start": 1}))
    async with fault_run(options) as run:
        agent = await run.spawn_agent("far", ranks=1, wrapper=("ip", "netns", "exec", namespace),
                                      controller_host=near_address)
        await agent.wait_for("fault-rank 0 step 3", FORMATION_BOUND_SECS)
        _ip("link", "set", near, "down")
        cut_at = time.monotonic()
        try:
            result = await asyncio.wait_for(run.controller.wait(), VERDICT_BOUND_SECS)
            assert result.verdict is Phase.FAILED
            assert "far" in result.reason, result.reason
            print(f"failed {time.monotonic() - cut_at:.1f}s after the link went down: {result.reason}")
            await run.controller.close()  # as `flodld serve` does once the run has ended
        finally:
            _ip("link", "set", near, "up")
        took = await run.until_no_processes(ORPHAN_BOUND_SECS)
        print(f"the far host's processes were gone {took:.1f}s after the link came back")
