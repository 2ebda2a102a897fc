"""A child's exit as the agent's supervisor hears it (`flodld.agent.supervision` events).

The relay's exit is `RelayExit`. A rank's is `RankExit`, with what its report needs: a clean exit only its
time; a failing rank also its exception (torch's @record error file, else the last line of the traceback in
its output tail), the tail itself, and when it failed: when it raised, not when its process was finally
gone (flodld/membership/rootcause.py picks the run's root cause by that time).
"""

from __future__ import annotations

import asyncio
import time

from flodld.agent import supervision as sv
from flodld.agent.children import Child
from flodld.agent.tail import Scrubber, failure_time, read_error_file

TAIL_DRAIN_SECS = 1.0
"""After a rank exits, how long its last output may take to reach the tail (a grandchild holding the pipe
open would otherwise hold the report)."""


async def exit_event(child: Child, forwarder: asyncio.Future[None] | None, scrub: Scrubber) -> sv.Event:
    """Wait for `child` to exit; its event. `forwarder` copies its output (into its tail), `scrub` keeps the
    run's secrets out of the exception read from its error file.
    """
    code = await child.process.wait()
    loop_now, wall_now = asyncio.get_running_loop().time(), time.time()
    if child.rank is None:
        return sv.RelayExit(code)
    if code == 0:
        return sv.RankExit(child.rank, code, loop_now, sv.ExitDetail(failed_at=wall_now))
    # The traceback is the last thing a failing rank prints: let the forwarder read it to the end.
    if forwarder is not None:
        await asyncio.wait({forwarder}, timeout=TAIL_DRAIN_SECS)
    error = read_error_file(child.error_file, scrub)
    tail = child.tail
    # A rank fails when it raises (error file written, traceback printed), not when its process is
    # finally gone: torch closes its connections while the interpreter shuts down, so a peer can exit
    # first, and our teardown can catch the culprit mid-shutdown (flodld/membership/rootcause.py).
    failed_at = failure_time(
        wall_now,
        error.written_at if error is not None else None,
        tail.traceback_at if tail is not None else None,
    )
    # Without @record's file, the exception is the last line of the traceback in the tail.
    message = error.message if error is not None else tail.exception_line() if tail is not None else None
    detail = sv.ExitDetail(failed_at, message, tail.render() if tail is not None else None)
    return sv.RankExit(child.rank, code, loop_now - (wall_now - failed_at), detail)
