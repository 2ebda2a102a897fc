"""Raw HTTP and daemon helpers for the POST /start and trust tests (real `flodld serve` processes)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import signal

from tests.serve import run_to_exit, serve_argv

from .agents import Agent
from .daemon_proc import Daemon

START = {"X-Flodld-Start": "1"}  # what `fdl start` sends: a loopback caller that is not a web page


def credential(token: str, run_id: str = "daemon-run") -> str:
    """The documented derivation, written out here: HMAC-SHA256(salt, "flodld/start/v2" NUL run_id), hex.

    `start_daemon` runs `--once --run-id daemon-run`, so that is its run's id.
    """
    message = b"flodld/start/v2\x00" + run_id.encode()
    return hmac.new(bytes.fromhex(token), message, hashlib.sha256).hexdigest()


async def raw(
    port: int, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request; (status, lower-cased headers, body). Status 0: closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", "Content-Length: 0"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    try:
        answer = await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        answer = b""
    writer.close()
    if not answer:
        return 0, {}, b""
    head, _, body = answer.partition(b"\r\n\r\n")
    first, *rest = head.decode().split("\r\n")
    fields = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in rest)
    }
    return int(first.split(" ", 2)[1]), fields, body


async def arm_and_finish(daemon: Daemon, agent: Agent, headers: dict[str, str]) -> None:
    """The window still stages; POST /start with HEADERS arms it, and the one-host run ends with exit 0."""
    _, _, body = await raw(daemon.port, "GET", "/state.json")
    assert json.loads(body)["phase"] == "staging"
    status, _, body = await raw(daemon.port, "POST", "/start", headers)
    assert status == 200 and json.loads(body)["armed"] is True
    await agent.world()
    await agent.leave()
    assert await daemon.finish() == 0


async def stop(daemon: Daemon) -> None:
    if daemon.proc.returncode is None:
        daemon.proc.send_signal(signal.SIGTERM)
    await daemon.finish()


async def serve_exit(*flags: str) -> tuple[int | None, str]:
    """Run `flodld serve --once --port 0 FLAGS`; (exit code, stderr). None: still running at 20 s (killed)."""
    return await run_to_exit(serve_argv("--once", *flags, bind=None))
