"""How tests start `flodld serve` as a child process: one argv builder, one way to read the port back."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

LISTENING = re.compile(r"event=listening bind=\S+ port=(\d+)")
"""The daemon's log line once its port is open; group 1 is the port (the one to use with `--port 0`)."""


def listening_port(log: str | bytes) -> int | None:
    """The port a `flodld serve` log says it listens on, or None before that line."""
    found = LISTENING.search(log.decode(errors="replace") if isinstance(log, bytes) else log)
    return int(found.group(1)) if found else None


def serve_argv(
    *flags: str,
    config: Path | None = None,
    port: int | None = 0,
    bind: str | None = "127.0.0.1",
    run_id: str | None = None,
) -> list[str]:
    """`python -m flodld serve` with each option that is not None, then FLAGS."""
    argv = [sys.executable, "-m", "flodld", "serve"]
    if config is not None:
        argv += ["--config", str(config)]
    if port is not None:
        argv += ["--port", str(port)]
    if bind is not None:
        argv += ["--bind", bind]
    if run_id is not None:
        argv += ["--run-id", run_id]
    return [*argv, *flags]


async def run_to_exit(argv: list[str], timeout: float = 20) -> tuple[int | None, str]:
    """Run ARGV (a serve_argv) to its end; (exit code, stderr). None: it still ran after TIMEOUT (killed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        return None, err.decode(errors="replace")
    return proc.returncode, err.decode(errors="replace")
