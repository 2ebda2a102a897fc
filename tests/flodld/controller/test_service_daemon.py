"""`flodld serve` (the service) as a real process: SIGHUP reloads for the next window, a broken config
keeps the old one and says so in state.json, SIGTERM between runs exits 0.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flodld.net.stream import open_channel
from flodld.wire.join import Accept, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.salt import salt_from_hex
from tests.reliability.daemon import hello, state
from tests.reliability.process import DaemonProcess, write_config
from tests.serve import run_to_exit, serve_argv

pytestmark = pytest.mark.multiproc


async def eventually_state(
    port: int, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        body = await state(port)
        if predicate(body):
            return body
        assert loop.time() < deadline, body
        await asyncio.sleep(0.1)


async def one_host_run(port: int, token: str, host: str) -> None:
    stream = await open_channel("127.0.0.1", port, Channel.JOIN, salt_from_hex(token), timeout=5)
    await stream.send(hello(host))
    assert isinstance((await stream.recv(5)).message(), Accept)
    assert isinstance((await stream.recv(10)).message(), WorldFormed)
    await stream.aclose()  # no ranks reported: the run fails (the host is lost), which is a verdict too


async def test_sighup_reloads_for_the_next_window_and_a_broken_config_is_kept_out(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, target=1, min_ranks=1)
    try:
        first = await eventually_state(daemon.port, lambda s: s["phase"] == "waiting")
        assert first["target"] == 1 and first["service"]["config_error"] is None
        good = daemon.config.read_text()
        daemon.config.write_text(good + "  nonsense_key: 1\n")
        daemon.proc.send_signal(signal.SIGHUP)
        broken = await eventually_state(daemon.port, lambda s: s["service"]["config_error"] is not None)
        assert "nonsense_key" in broken["service"]["config_error"]
        assert "event=reload_failed" in daemon.wait_for_line("event=reload_failed")
        write_config(tmp_path, daemon.token, target=2, min_ranks=1)
        daemon.proc.send_signal(signal.SIGHUP)
        await eventually_state(daemon.port, lambda s: s["service"]["config_error"] is None)
        assert (await state(daemon.port))["target"] == 1  # the open window keeps its config
        await one_host_run(daemon.port, daemon.token, "h1")
        second = await eventually_state(daemon.port, lambda s: s["service"]["runs_started"] == 2
                                        and s["phase"] == "waiting")
        assert second["target"] == 2
        assert [h["run_id"] for h in second["history"]] == [first["run_id"]]
        assert second["run_id"] != first["run_id"]
        code = await asyncio.get_running_loop().run_in_executor(None, daemon.terminate)
        assert code == 0
        assert "Traceback" not in daemon.log
    finally:
        daemon.kill()


async def test_bad_config_at_start_exits_two(tmp_path: Path) -> None:
    config = tmp_path / "fdl.yml"
    config.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n    between_runs_secs: -1\n  workers: []\n"
    )
    code, err = await run_to_exit(serve_argv(config=config, bind=None), timeout=30)
    assert code == 2, err
    assert "between_runs_secs" in err
