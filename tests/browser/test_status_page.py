"""The status page in a real headless chromium, against a live `flodld serve` (the service) on 127.0.0.1.

What a person would see: a first run forms and finishes and shows in the history with its verdict; in
the next window the phase turns from waiting to staging when walk-ins join, the window countdown ticks
down, the host table lists the walk-ins, the missing roster and refusals show. The page sends nothing
but same-origin GETs, and with JavaScript off the server-rendered page says the same.
The screenshot is kept in the test's temp dir (a CI artifact); FLODLD_DOC_SCREENSHOT=<path> also
writes it there (how docs/img/status-page-staging.png is made).

Skips without chromium, fails instead under FLODLD_REQUIRE_BROWSER=1 (what `.ci/run` sets).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from flodld.wire.join import Reject
from flodld.wire.salt import new_salt, salt_from_hex
from tests.conftest import require_binary
from tests.flodld.controller.agents import http, join
from tests.serve import listening_port, serve_argv

from .cdp import headless_page

pytestmark = pytest.mark.multiproc

_COUNTDOWN = re.compile(r"^(?:(\d+)h (\d+)m|(?:(\d+)m )?(\d+)s) left$")


def seconds_left(text: str | None) -> int:
    """'1m 58s left' -> 118 (the page's countdown as a person reads it)."""
    found = _COUNTDOWN.match(text or "")
    assert found, f"not a countdown: {text!r}"
    hours, minutes_h, minutes, secs = (int(g) if g else 0 for g in found.groups())
    return hours * 3600 + minutes_h * 60 + minutes * 60 + secs


def test_seconds_left_parses_each_countdown_shape() -> None:
    assert [seconds_left(t) for t in ("7s left", "1m 05s left", "2h 07m left")] == [7, 65, 2 * 3600 + 7 * 60]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(tmp_path: Path) -> Path:
    """A hybrid window: quorum 3, target 6; one configured worker that never comes (missing).

    Walk-ins are allowed (the target is above the roster's 2 ranks). The port in the file is only for
    validation: serve gets --port 0.
    """
    path = tmp_path / "fdl.yml"
    path.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n"
        f"    port: {_free_port()}\n"
        "    between_runs_secs: 0\n"
        "    join: {min_rank_start: 3, target_ranks: 6, join_timeout: 180, max_join_timeout: 600, "
        "start: hybrid}\n"
        "  workers:\n    - host: gpu-node-7\n      local_devices: ['cpu:2']\n      path: /srv/project\n"
    )
    return path


@asynccontextmanager
async def serve(tmp_path: Path, token: str) -> AsyncIterator[int]:
    """`flodld serve` as a service (one run after another), its log in the temp dir; yields the port."""
    log = tmp_path / "flodld-serve.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *serve_argv("--token", token, config=_config(tmp_path), run_id="sweep"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
        )
    try:
        for _ in range(300):
            port = listening_port(log.read_text(errors="replace"))
            if port is not None:
                break
            assert proc.returncode is None, log.read_text(errors="replace")
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"flodld serve did not listen: {log.read_text(errors='replace')}")
        yield port
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


_HOST_ROWS = "Array.from(document.querySelectorAll('#hosts tbody tr')).map(r => r.innerText.split('\\t'))"


_HISTORY_ROWS = (
    "Array.from(document.querySelectorAll('#history tbody tr')).map(r => r.innerText.split('\\t'))"
)
START = {"X-Flodld-Start": "1"}  # what `fdl start` sends


async def _first_run(port: int, salt: bytes) -> None:
    """Run 1: two walk-ins, the operator fires the start, the world forms, every rank exits 0."""
    agents = [await join(port, salt, "node-a", devices=1), await join(port, salt, "node-b", devices=2)]
    assert [agent.accepted.ranks for agent in agents] == [[0], [1, 2]]
    status, body = await http(port, "POST", "/start", START)
    assert status == 200 and body["armed"] is True, body
    for agent in agents:
        await agent.world()
    for agent in agents:
        await agent.leave()


async def test_status_page_in_headless_chromium_history_then_waiting_to_staging(tmp_path: Path) -> None:
    chromium = require_binary("browser", "chromium")
    token = new_salt().hex()
    salt = salt_from_hex(token)
    async with serve(tmp_path, token) as port, headless_page(chromium, tmp_path / "profile") as page:
        origin = f"http://127.0.0.1:{port}"
        await page.navigate(f"{origin}/status")
        await page.wait_for("document.getElementById('app').dataset.source === 'live'")  # the script runs
        assert await page.text("#run-id") == "sweep-1"
        assert await page.text("#history .empty") == "no finished runs yet"

        await _first_run(port, salt)
        await page.wait_for("document.getElementById('run-id').innerText === 'sweep-2'", timeout=10)
        await page.wait_for("document.querySelector('#history tbody') !== null", timeout=5)
        history = await page.evaluate(_HISTORY_ROWS)
        assert len(history) == 1 and history[0][:2] == ["sweep-1", "done"], history
        assert history[0][5:8] == ["3", "node-a, node-b", "all 3 exited 0"], history
        assert re.fullmatch(r"\+\d+\.\ds", history[0][3]), history  # formed after, in tenths under a minute
        assert re.fullmatch(r"\d+\.\ds", history[0][4]), history  # the run's duration
        assert "service: run 2 · 1 done, 0 failed" in (await page.text("#service") or "")

        assert await page.text("#phase") == "waiting"
        assert "waiting for quorum: 0 of 3 ranks" in (await page.text("#reason") or "")
        assert await page.text("#hosts .empty") == "none joined yet"
        assert await page.evaluate(
            "Array.from(document.querySelectorAll('#missing li')).map(e => e.innerText)"
        ) == ["gpu-node-7"]
        assert "hybrid — waiting for quorum (0 of 3 ranks)" in (await page.text("#start-text") or "")

        first = seconds_left(await page.text("#window"))
        await asyncio.sleep(2.2)
        later = seconds_left(await page.text("#window"))
        assert 1 <= first - later <= 10, (first, later)  # it ticks down with the clock
        assert seconds_left(await page.text("#cap")) > later

        walk_ins = [await join(port, salt, "node-a", devices=1), await join(port, salt, "node-b", devices=2)]
        duplicate = await join(port, salt, "node-a")
        assert isinstance(duplicate.reply, Reject)
        await page.wait_for("document.getElementById('phase').innerText === 'staging'", timeout=5)
        rows = await page.evaluate(_HOST_ROWS)
        assert [row[:4] + row[5:] for row in rows] == [
            ["node-a", "0", "1× cpu:0", "cpu", "open"],
            ["node-b", "1–2", "cpu:0, cpu:1", "cpu", "open"],
        ]
        assert all(re.fullmatch(r"\+\d+s", row[4]) for row in rows), rows  # joined, seconds into the window
        # The same rows and headline as the server renders them (JavaScript off): the script's twins of the
        # row wordings agree with flodld/controller/status/summary.py, and the headline is the summary's.
        async with headless_page(chromium, tmp_path / "profile-plain", javascript=False) as plain:
            await plain.navigate(f"{origin}/status")
            assert await plain.evaluate("document.getElementById('app').dataset.source") == "server"
            served = await plain.evaluate(_HOST_ROWS)
            assert [row[:4] + row[5:] for row in served] == [row[:4] + row[5:] for row in rows], served
            for element in ("#rank-count", "#start-text", "#phase"):
                assert await plain.text(element) == await page.text(element), element
        assert (await page.text("#rank-count") or "").startswith(
            "3 joined across 2 host(s) — quorum 3, target 6"
        )
        assert await page.text("#start-text") == "hybrid — startable — fire with `fdl start`"
        assert await page.evaluate("document.querySelector('#ranks .bar').className") == "bar met"
        await page.wait_for("document.querySelector('#refused tbody') !== null", timeout=5)
        refused = await page.evaluate(
            "Array.from(document.querySelectorAll('#refused tbody tr')).map(r => r.innerText.split('\\t'))"
        )
        # Only the duplicate: the page's own polling never leaves a keep-alive connection for the mux to cut
        # (that would count as connection_http_lifetime). A connection closed before any byte is not the
        # page's (a browser's request sends its bytes): on a loaded CI machine another test's process may
        # probe a port number that this daemon now holds, and the mux counts that too.
        refused = [row for row in refused if row[0] != "connection_eof_before_magic"]
        assert refused == [["duplicate_host", "1"]], refused
        assert await page.evaluate("document.title") == "flodld · sweep-2 · staging"
        assert seconds_left(await page.text("#window")) <= later

        shot = tmp_path / "status-page-staging.png"
        await page.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
        if os.environ.get("FLODLD_DOC_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["FLODLD_DOC_SCREENSHOT"])

        # Read-only: same-origin GETs only, never a token; and nothing the CSP had to block.
        assert page.requests, "the page sent no request"
        for method, url in page.requests:
            assert method == "GET" and url.startswith(origin + "/"), (method, url)
            assert "token" not in url and token not in url
        assert {url.removeprefix(origin) for _, url in page.requests} >= {
            "/status",
            "/status.css",
            "/status.js",
            "/state.json",
        }
        assert sum(1 for _, url in page.requests if url.endswith("/state.json")) >= 3
        assert not [
            line for line in page.console if "Content Security Policy" in line or "exception" in line
        ], page.console

        # JavaScript off: the server-rendered page says the same.
        async with headless_page(chromium, tmp_path / "profile-nojs", javascript=False) as plain:
            await plain.navigate(f"{origin}/")
            assert await plain.evaluate("document.getElementById('app').dataset.source") == "server"
            assert await plain.text("#phase") == "staging"
            rows = await plain.evaluate(_HOST_ROWS)
            assert [row[:2] for row in rows] == [["node-a", "0"], ["node-b", "1–2"]]
            assert (await plain.evaluate(_HISTORY_ROWS))[0][:2] == ["sweep-1", "done"]
            assert "left" in (await plain.text("#window") or "")
        for agent in walk_ins:
            await agent.stream.aclose()
