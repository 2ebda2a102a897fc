"""The controller killed and restarted while a persist-mode walk-in (`fdl join --persist`) waits: the
walk-in re-dials the new controller on the same port within REDIAL_BOUND_SECS, and nothing is orphaned.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .daemon import state
from .process import DaemonProcess
from .workers import FAST_ENV, MARK, PROGRAM, marked_processes

pytestmark = pytest.mark.multiproc

JOIN_BOUND_SECS = 20.0
# fdl join backs off 5 s * FLODL_NET_TIMEOUT_SCALE (0.2) = 1 s, then the agent's dial retries 0.5 s apart.
REDIAL_BOUND_SECS = 10.0
ORPHAN_BOUND_SECS = 10.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _until_joined(port: int, host: str, bound: float) -> float:
    begun = time.monotonic()
    while True:
        try:
            body = await state(port)
            if any(m["host"] == host for m in body["members"]):
                return time.monotonic() - begun
        except (OSError, AssertionError):
            pass
        if time.monotonic() - begun > bound:
            raise AssertionError(f"{host} did not join the controller on port {port} within {bound}s")
        await asyncio.sleep(0.1)


async def test_a_persist_walk_in_rejoins_a_restarted_controller(tmp_path: Path) -> None:
    port = _free_port()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = DaemonProcess(tmp_path / "one", port=port)
    mark = uuid.uuid4().hex
    fdl = Path(sys.executable).with_name("fdl")
    walk_in = subprocess.Popen(
        [str(fdl), "join", f"127.0.0.1:{port}", "--bin", str(PROGRAM), "--host", "walker", "--devices", "cpu",
         "--persist"],
        env={**os.environ, **FAST_ENV, "FDL_JOIN_TOKEN": first.token, MARK: mark},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    second: DaemonProcess | None = None
    try:
        await _until_joined(port, "walker", JOIN_BOUND_SECS)
        first.kill()
        second = DaemonProcess(tmp_path / "two", port=port, token=first.token)
        took = await _until_joined(port, "walker", REDIAL_BOUND_SECS)
        print(f"walk-in back {took:.2f}s after the new controller listened")
        assert walk_in.poll() is None, "fdl join --persist gave up"
    finally:
        walk_in.send_signal(signal.SIGTERM)
        try:
            walk_in.wait(ORPHAN_BOUND_SECS)
        except subprocess.TimeoutExpired:
            walk_in.kill()
            raise
        finally:
            first.kill()
            if second is not None:
                second.kill()
        deadline = time.monotonic() + ORPHAN_BOUND_SECS
        while marked_processes(mark) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert marked_processes(mark) == []
    assert walk_in.stderr is not None
    assert first.token not in walk_in.stderr.read()
