"""`python -m flodld.launcher.rank SCRIPT.py [ARGS]`: how an agent starts a Python rank.

Before the script runs, flodld does in the rank what `flodld.run` would: it takes the session salt out
of the environment (so the script's own subprocesses never inherit it) and, on a host with a relay,
opens the rank's legs to it, whose heartbeats keep the controller from declaring a stock script (one
that never imports flodld) dead after the startup grace, and whose control watch ends the rank if the
controller is lost. A flodld program that later calls `flodld.run`/`init_process_group` gets the same
legs (they open once per process). Then the script runs as `python SCRIPT.py ARGS` would run it:
`__name__ == "__main__"`, `sys.argv[0]` the script, its directory first on `sys.path`. At exit, after the
script's own `atexit` handlers, flodld closes a process group the script left open and lets gloo's worker
threads go idle before the interpreter shuts down (see `flodld.rank.process_group.quiesce_gloo_workers`).
Last of all it collects the garbage once and freezes what is left (see `_collect_once_before_shutdown`): a
rank that loaded torch then ends about twice as fast once its script is done (0.8 s -> 0.4 s here).

`python -m flodld.launcher.rank --warm` is a warm rank (`flodld.rank.warm`): it loads torch first, then
reads its script, arguments and environment from one line on stdin and goes on as above.
`python -m flodld.launcher.rank --fork-server` loads torch once and forks a rank per request
(`flodld.launcher.forkserver`); each fork goes on as above.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

from flodld.rank.env import claim_salt, in_flodld_rank, read_rank_environment, register_stack_dump
from flodld.rank.warm import (
    FORK_SERVER_FLAG,
    MAX_HANDOFF_BYTES,
    WARM_FLAG,
    HandoffError,
    decode_handoff,
)


def main(argv: list[str]) -> None:
    if argv[:1] == [FORK_SERVER_FLAG] and len(argv) == 2 and argv[1].isdigit():
        argv = _serve_forks(int(argv[1]))  # returns in a forked child only
        from flodld.agent.spawn import RELAY_HANDOFF  # loaded by the fork server already

        if argv == RELAY_HANDOFF:  # a relay (`python -m flodld.launcher`), forked with torch loaded
            runpy.run_module(RELAY_HANDOFF[1], run_name="__main__", alter_sys=True)
            return
    atexit.register(_collect_once_before_shutdown)  # registered before any other of ours: runs after them
    if argv == [WARM_FLAG]:
        argv = _wait_warm()
    if not argv:
        sys.stderr.write("usage: python -m flodld.launcher.rank SCRIPT.py [ARGS]\n")
        sys.exit(2)
    claim_salt()
    register_stack_dump()  # where it was, when the agent asks (a rank declared dead)
    if in_flodld_rank() and os.environ.get("FLODL_RELAY_PORT"):
        from flodld.rank.relay_client import connect_relay  # loads torch: only in a rank that has a relay

        connect_relay(read_rank_environment())
    atexit.register(_settle_torch_distributed)  # registered first, so it runs after the script's own handlers
    script = os.path.abspath(argv[0])  # `__file__` is absolute, as for `python SCRIPT.py` since Python 3.9
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:
        _record_failure(error)
        raise


def _wait_warm() -> list[str]:
    """A warm rank (flodld.rank.warm): load torch now, then take argv and environment from stdin.

    EOF before a hand-off (the agent did not need this rank) ends the process quietly.
    """
    import torch  # the point of a warm rank: the import is paid before the world forms
    import torch.distributed  # noqa: F401

    import flodld.rank.relay_client  # noqa: F401  what a rank with a relay opens first

    line = sys.stdin.buffer.readline(MAX_HANDOFF_BYTES + 1)
    if not line.endswith(b"\n"):
        sys.exit(0)
    try:
        argv, env = decode_handoff(line)
    except HandoffError as error:
        sys.stderr.write(f"flodld warm rank: {error}\n")
        sys.exit(2)
    os.environ.clear()  # exactly the rank's environment, as if it had been started with it
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)  # a rank's stdin is /dev/null, as for a cold start
    os.dup2(devnull, 0)
    os.close(devnull)
    return argv


def _serve_forks(listen_fd: int) -> list[str]:
    """The fork server (flodld.launcher.forkserver): load torch once, then fork ranks on request; the
    argv of the rank this process has become.
    """
    import socket

    from flodld.launcher import forkserver

    forkserver.preload()
    listener = socket.socket(fileno=listen_fd)
    return forkserver.serve(listener)


def _record_failure(error: BaseException) -> None:
    """As torch's `@record` does, write the exception that ends the script to TORCHELASTIC_ERROR_FILE (the
    agent's private directory), unless the script's own `@record` already did: the agent then dates the
    failure by the file, not by when its output or exit reached it (flodld/agent/tail.py). Best effort.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import json
    import time
    import traceback

    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    record = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "x", encoding="utf-8") as handle:  # never over a file @record wrote meanwhile
            json.dump(record, handle)
    except OSError:
        pass


def _settle_torch_distributed() -> None:
    """At exit, before the interpreter shuts down: close a process group the script left open and let
    gloo's worker threads finish freeing their last work (see `quiesce_gloo_workers`). A script that
    never touched torch.distributed pays nothing.
    """
    if "torch.distributed" not in sys.modules:
        return
    from flodld.rank.process_group import close_process_group  # loads torch: only if the script did

    close_process_group()


def _collect_once_before_shutdown() -> None:
    """The last atexit handler: one full collection while the interpreter is still whole (every cyclic
    garbage's finalizer runs, as at shutdown), then `gc.freeze()`, so the collections of the interpreter's
    own finalization skip the survivors. Those passes walk every object torch loaded, several times, as the
    modules are torn down: about 0.5 s of CPU per rank on a loaded 2-core host, for nothing, since the
    process's memory goes back to the system either way. What becomes garbage only while the modules are
    torn down (an object in a cycle with a module's globals) is then freed with the process, its `__del__`
    not called, which Python never promises at exit anyway; objects freed by reference count (a module's
    open file, flushed on close) are freed as before.
    """
    import gc

    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    main(sys.argv[1:])
