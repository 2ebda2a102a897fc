"""Stopping an agent a launcher started on this machine (`fdl run`'s local hosts, `fdl join --ssh`)."""

from __future__ import annotations

import asyncio

STOP_MARGIN_SECS = 5.0
"""Past the agent's own teardown grace: the time it needs to report its children and close its link."""


async def stop_local_agent(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """TERM `process` if it still runs, give it its teardown grace (`grace_s`, the TERM-to-KILL time it gives
    its own children) plus `STOP_MARGIN_SECS` to exit, then KILL it; returns once it is gone.
    """
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), grace_s + STOP_MARGIN_SECS)
    except TimeoutError:
        process.kill()
        await process.wait()
