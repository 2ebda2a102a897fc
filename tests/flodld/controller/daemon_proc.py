"""Start `python -m flodld serve` as a real subprocess and find its port from the log."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from tests.serve import listening_port, serve_argv


@dataclass
class Daemon:
    proc: asyncio.subprocess.Process
    port: int
    log: bytearray

    async def finish(self, timeout: float = 10.0) -> int:
        assert self.proc.stderr is not None
        rest = await asyncio.wait_for(self.proc.stderr.read(), timeout)
        self.log += rest
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def start_daemon(*flags: str, env: dict[str, str] | None = None) -> Daemon:
    proc = await asyncio.create_subprocess_exec(
        *serve_argv("--once", *flags, run_id="daemon-run"),
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert proc.stderr is not None
    log = bytearray()
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        if not line:
            raise AssertionError(f"daemon exited before listening: {log.decode(errors='replace')}")
        log += line
        port = listening_port(line)
        if port is not None:
            return Daemon(proc, port, log)
