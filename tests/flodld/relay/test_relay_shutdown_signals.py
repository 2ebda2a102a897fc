"""A TERM that reaches a relay while it is already shutting down is ignored quietly.

The relay often stops on its own (every rank left) as the agent's TERM arrives. asyncio closes the
loop's self-pipe before it removes its signal handlers; a TERM in between used to make the C handler
write to the closed wakeup fd: "Exception ignored when trying to write to the signal wakeup fd ...
Bad file descriptor" at the end of a plain `fdl run`. The script below delivers a real SIGTERM at
exactly that moment (right after the self-pipe closed) to the real `run_relay`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import asyncio, os, signal, sys

import flodld.relay.server as server
import flodld.relay.spec as spec


class Relay:  # stands in for the network side only: it stops at once, as after 'every local rank has left'
    def __init__(self, _spec):
        pass

    def stop(self, why, code):
        pass

    async def run(self):
        return 0


class LateTermLoop(asyncio.SelectorEventLoop):
    def _close_self_pipe(self):
        super()._close_self_pipe()
        os.kill(os.getpid(), signal.SIGTERM)  # the agent's TERM, as asyncio tears the loop down


class Policy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return LateTermLoop()


spec.relay_spec_from_env = lambda: None
server.Relay = Relay
asyncio.set_event_loop_policy(Policy())
code = server.run_relay()
print("relay returned", code, flush=True)
"""


def test_a_term_during_loop_teardown_neither_warns_nor_kills_the_relay() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "wakeup fd" not in done.stderr and "Bad file descriptor" not in done.stderr, done.stderr
    assert done.returncode == 0 and done.stdout.strip() == "relay returned 0", (done.returncode, done.stderr)
