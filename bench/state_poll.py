"""What one state.json poll costs the controller, against a 404 on the same port (aiohttp's path).

    .venv/bin/python bench/state_poll.py [--polls 8000] [--clients 8] [--rounds 2]

One `flodld serve --once` with its window open (so state.json has state), polled the way
`bench/join_storm.py`'s pollers poll: a new TCP connection per request, `Connection: close`, read to EOF,
`--clients` requests in flight. Rounds alternate `GET /state.json` (answered by the port itself from the
cached bytes, `flodld.controller.status.fastget`) and `GET /nope` (routed, answered and closed by aiohttp: the
baseline). Per round: requests/s and the controller's CPU per request (user + system, from /proc; the
kernel's share of a loopback connection included). Last line: the medians' ratio, state.json over 404.

The window is empty, so the body is small: this is the cost of the request path, not of the body's size
(with 10,000 hosts the default page is tens of KiB more to send per poll).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path

_PORT = re.compile(rb"event=listening bind=\S+ port=(\d+)")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds the process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


async def _request(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    return answer


async def _round(port: int, pid: int, path: str, polls: int, clients: int) -> tuple[float, float, float]:
    """(requests/s, controller user µs per request, system µs per request)."""
    left = polls

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await _request(port, path)

    (user0, sys0), begun = _cpu(pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    (user1, sys1), elapsed = _cpu(pid), time.perf_counter() - begun
    return polls / elapsed, 1e6 * (user1 - user0) / polls, 1e6 * (sys1 - sys0) / polls


async def main(options: argparse.Namespace) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flodld", "serve", "--once", "--port", "0", "--bind", "127.0.0.1",
        "--ranks", "100", "--token", secrets.token_bytes(16).hex(), "--window", "600",
        stderr=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent,
    )  # fmt: skip
    assert proc.stderr is not None
    drain: asyncio.Task[bytes] | None = None
    try:
        while (found := _PORT.search(await asyncio.wait_for(proc.stderr.readline(), 60))) is None:
            if proc.returncode is not None:
                raise SystemExit("flodld serve exited before listening")
        port = int(found.group(1))
        drain = asyncio.create_task(proc.stderr.read())  # keep the log pipe flowing
        for path, status in (("/state.json", b" 200 "), ("/nope", b" 404 ")):  # warm up, and check
            first = (await _request(port, path)).split(b"\r\n", 1)[0]
            if status not in first:
                raise SystemExit(f"GET {path}: {first!r}")
        print(f"{options.polls} requests per round, {options.clients} in flight, a new connection each")
        print("| path | requests/s | controller CPU per request (user + system) |\n|---|---|---|")
        costs: dict[str, list[float]] = {"/state.json": [], "/nope": []}
        for _ in range(options.rounds):
            for path, spent in costs.items():
                rate, user, system = await _round(port, proc.pid, path, options.polls, options.clients)
                spent.append(user + system)
                cost = f"{user + system:.0f} µs ({user:.0f} + {system:.0f})"
                print(f"| {path} | {rate:,.0f} | {cost} |", flush=True)
        state, baseline = (statistics.median(spent) for spent in costs.values())
        print(
            f"state.json / 404 controller CPU per request: {state:.0f} / {baseline:.0f} µs = "
            f"{state / baseline:.2f}"
        )
        return 0
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            drain.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--polls", type=int, default=8000, help="requests per round")
    parser.add_argument("--clients", type=int, default=8, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each path, alternating")
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    sys.exit(runner(main(parser.parse_args())))
