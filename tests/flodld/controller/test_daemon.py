"""`flodld serve` as a real process: readiness, state.json over curl, signals and exit codes."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from flodld.membership.snapshot import StateSnapshot
from flodld.wire.salt import new_salt, salt_from_hex
from tests.conftest import require_binary
from tests.serve import run_to_exit, serve_argv

from .agents import http, join
from .daemon_proc import start_daemon

pytestmark = pytest.mark.multiproc

START = {"X-Flodld-Start": "1"}  # what `fdl start` sends: a loopback caller that is not a web page


async def _curl(*args: str) -> tuple[int, bytes]:
    curl = require_binary("curl", "curl")  # FLODLD_REQUIRE_CURL=1 (CI) fails instead of skipping
    proc = await asyncio.create_subprocess_exec(curl, "-s", "-w", "\n%{http_code}", *args,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    body, _, code = out.rpartition(b"\n")
    return int(code), body


async def test_serve_notifies_systemd_serves_state_json_and_exits_zero_when_the_run_is_done() -> None:
    token = new_salt().hex()
    with tempfile.TemporaryDirectory() as tmp:
        notify_path = str(Path(tmp) / "notify.sock")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        notify.setblocking(False)
        daemon = await start_daemon("--ranks", "2", "--token", token, "--window", "20",
                                    env={"NOTIFY_SOCKET": notify_path})
        try:
            loop = asyncio.get_running_loop()
            ready = (await asyncio.wait_for(loop.sock_recv(notify, 4096), 10)).decode()
            assert "READY=1" in ready and "STATUS=listening" in ready  # readiness comes first, once bound
            code, body = await _curl(f"http://127.0.0.1:{daemon.port}/state.json")
            assert code == 200
            state = StateSnapshot.model_validate(json.loads(body))  # matches the published schema
            assert state.phase == "waiting" and state.quorum == 2 and state.run_id == "daemon-run"
            code, body = await _curl(f"http://127.0.0.1:{daemon.port}/nowhere")
            assert code == 404 and "/state.json" in json.loads(body)["endpoints"][1]
            salt = salt_from_hex(token)
            a, b = await join(daemon.port, salt, "a"), await join(daemon.port, salt, "b")
            await a.world()
            await b.world()
            await a.leave()
            await b.leave()
            assert await daemon.finish() == 0
            statuses = []
            while True:
                try:
                    statuses.append(notify.recv(4096).decode())
                except BlockingIOError:
                    break
            assert any("STATUS=training" in s for s in statuses) and any(
                "STOPPING=1" in s for s in statuses
            ), statuses
        finally:
            daemon.kill()
            notify.close()


async def test_sigterm_aborts_every_link_closes_the_port_and_exits_non_zero() -> None:
    token = new_salt().hex()
    daemon = await start_daemon("--ranks", "3", "--token", token, "--window", "20")
    try:
        agent = await join(daemon.port, salt_from_hex(token), "a")
        daemon.proc.send_signal(signal.SIGTERM)
        abort = await agent.abort()
        assert "SIGTERM" in abort.reason
        assert await daemon.finish() == 128 + signal.SIGTERM
        assert b"SIGTERM" in daemon.log
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", daemon.port)
    finally:
        daemon.kill()


async def test_post_start_refusals_answer_each_documented_status() -> None:
    token = new_salt().hex()
    auto = await start_daemon("--ranks", "1", "--token", token)
    try:
        status, body = await http(auto.port, "POST", "/start", START)
        assert (status, body["code"]) == (409, "auto_mode")
    finally:
        auto.proc.send_signal(signal.SIGTERM)
        await auto.finish()
    manual = await start_daemon(
        "--ranks", "2", "--token", token, "--start", "manual", "--window", "0.1", "--cap", "30"
    )
    try:
        status, body = await http(manual.port, "POST", "/start", START)
        assert (status, body["code"]) == (409, "quorum_not_met") and "0 of 2" in body["error"]
        agents = [await join(manual.port, salt_from_hex(token), h) for h in ("a", "b")]
        code, raw = await _curl(
            "-X", "POST", "-H", "X-Flodld-Start: 1", f"http://127.0.0.1:{manual.port}/start"
        )
        assert code == 200 and json.loads(raw)["armed"] is True
        await asyncio.gather(*(agent.world() for agent in agents))
        status, body = await http(manual.port, "POST", "/start", START)
        assert status == 409 and body["code"] == "window_closed" and "phase" in body["error"]
        for agent in agents:
            await agent.leave()
        assert await manual.finish() == 0
    finally:
        manual.kill()


async def test_bad_config_exits_two_with_a_reason() -> None:
    code, err = await run_to_exit(serve_argv("--start", "manual", "--target", "2", "--ranks", "2", bind=None))
    assert code == 2 and "target_ranks" in err


async def test_serve_reads_the_cluster_config_and_its_overlay(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_text("{}\n")
    (tmp_path / "fdl.lab.yml").write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n    port: 0\n"
        "    join: {join_timeout: 0.2, max_join_timeout: 0.4}\n"
        "  workers:\n    - host: localhost\n      local_devices: ['cpu:2']\n"
    )
    daemon = await start_daemon("--config", str(tmp_path / "fdl.yml"), "--env", "lab")
    try:
        assert await daemon.finish() == 1  # nobody joined: the 0.4 s hard cap fails the window
        assert b"quorum not met: 0 of 2 ranks" in daemon.log
    finally:
        daemon.kill()
