"""Start `python -m flodld serve` as a real subprocess and find its port from the log."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass

_LISTENING = re.compile(rb"event=listening bind=\S+ port=(\d+)")


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
        sys.executable,
        "-m",
        "flodld",
        "serve",
        "--once",
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--run-id",
        "daemon-run",
        *flags,
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
        found = _LISTENING.search(line)
        if found:
            return Daemon(proc, int(found.group(1)), log)
