"""`fdl join --persist` stopped by SIGTERM while it backs off between dials says so and dials no more."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import REPO, child_env

pytestmark = pytest.mark.multiproc

PROGRAM = "import sys, flodld\nsys.exit(flodld.run(lambda: 0, init_process_group=False))\n"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_sigterm_during_the_back_off_says_it_stopped(tmp_path: Path) -> None:
    (tmp_path / "walk.py").write_text(PROGRAM)
    # the smallest scale: nothing answers, so no handshake is bounded by it; the first dial gives up after 3 s
    env = child_env(PYTHONPATH=f"{REPO}:{REPO / 'clients'}", FLODL_NET_TIMEOUT_SCALE="0.1")
    env.pop("FDL_JOIN_TOKEN", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fdl.main", "join", f"127.0.0.1:{_closed_port()}", "--bin", "walk.py",
        "--devices", "cpu", "--persist", cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    seen: list[str] = []
    try:
        while not any("re-dialing in" in line for line in seen):  # the first dial failed: now it backs off
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, "".join(seen)
            seen.append(line.decode(errors="replace"))
        process.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    output = "".join(seen) + rest.decode(errors="replace")
    assert process.returncode == 1, output
    assert "fdl join: stopped (SIGTERM); not re-dialing" in output, output
    assert output.count("dialing controller") == 1, output  # no dial after the signal
