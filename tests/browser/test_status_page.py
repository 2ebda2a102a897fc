"""The status page in a real headless chromium, against a live `flodld serve` on 127.0.0.1.

What a person would see: the phase turns from waiting to staging when walk-ins join, the window
countdown ticks down, the host table lists the walk-ins, the missing roster and refusals show; the
page sends nothing but same-origin GETs, and with JavaScript off the server-rendered page says the same.
The screenshot is kept in the test's temp dir (a CI artifact); FLODLD_DOC_SCREENSHOT=<path> also
writes it there (how docs/img/status-page-staging.png is made).

History of finished runs needs the long-running service (issue 14): it is rendered when state.json
has it (unit-tested in tests/flodld/controller/test_page.py) and not asserted here.

Skips without chromium, fails instead under FLODLD_REQUIRE_BROWSER=1 (what `.ci/run` sets).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from flodld.wire.join import Reject
from flodld.wire.salt import new_salt, salt_from_hex
from tests.conftest import require_binary
from tests.flodld.controller.agents import join
from tests.flodld.controller.daemon_proc import start_daemon

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
    """A hybrid window: quorum 3, target 6; one configured worker that never comes (missing), walk-ins allowed
    (the target is above the roster's 2 ranks). The port in the file is only for validation: serve gets --port 0."""
    path = tmp_path / "fdl.yml"
    path.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n"
        f"    port: {_free_port()}\n"
        "    join: {min_rank_start: 3, target_ranks: 6, join_timeout: 180, max_join_timeout: 600, start: hybrid}\n"
        "  workers:\n    - host: gpu-node-7\n      local_devices: ['cpu:2']\n      path: /srv/project\n"
    )
    return path


_HOST_ROWS = "Array.from(document.querySelectorAll('#hosts tbody tr')).map(r => r.innerText.split('\\t'))"


async def test_status_page_in_headless_chromium_waiting_to_staging_with_walk_ins(tmp_path: Path) -> None:
    chromium = require_binary("browser", "chromium")
    token = new_salt().hex()
    daemon = await start_daemon("--config", str(_config(tmp_path), ), "--token", token)
    origin = f"http://127.0.0.1:{daemon.port}"
    try:
        async with headless_page(chromium, tmp_path / "profile") as page:
            await page.navigate(f"{origin}/status")
            await page.wait_for("document.getElementById('app').dataset.source === 'live'")  # the script runs
            assert await page.text("#phase") == "waiting"
            assert "waiting for quorum: 0 of 3 ranks" in (await page.text("#reason") or "")
            assert await page.text("#hosts .empty") == "none joined yet"
            assert await page.evaluate("Array.from(document.querySelectorAll('#missing li')).map(e => e.innerText)") \
                == ["gpu-node-7"]
            assert "hybrid — waiting for quorum (0 of 3 ranks)" in (await page.text("#start-text") or "")

            first = seconds_left(await page.text("#window"))
            await asyncio.sleep(2.2)
            later = seconds_left(await page.text("#window"))
            assert 1 <= first - later <= 10, (first, later)  # it ticks down with the clock
            assert seconds_left(await page.text("#cap")) > later

            salt = salt_from_hex(token)
            walk_ins = [await join(daemon.port, salt, "node-a", devices=1),
                        await join(daemon.port, salt, "node-b", devices=2)]
            duplicate = await join(daemon.port, salt, "node-a")
            assert isinstance(duplicate.reply, Reject)
            await page.wait_for("document.getElementById('phase').innerText === 'staging'", timeout=5)
            rows = await page.evaluate(_HOST_ROWS)
            assert [row[:4] + row[5:] for row in rows] == [["node-a", "0", "1× cpu:0", "cpu", "open"],
                                                           ["node-b", "1–2", "cpu:0, cpu:1", "cpu", "open"]]
            assert all(re.fullmatch(r"\+\d+s", row[4]) for row in rows), rows  # joined, seconds into the window
            assert (await page.text("#rank-count") or "").startswith("3 joined across 2 host(s) — quorum 3, target 6")
            assert await page.text("#start-text") == "hybrid — startable — fire with `fdl start`"
            assert await page.evaluate("document.querySelector('#ranks .bar').className") == "bar met"
            await page.wait_for("document.querySelector('#refused tbody') !== null", timeout=5)
            refused = await page.text("#refused tbody")
            assert refused is not None and refused.split("\t")[1].strip() == "1", refused
            assert await page.evaluate("document.title") == "flodld · daemon-run · staging"
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
                "/status", "/status.css", "/status.js", "/state.json"}
            polls = sum(1 for _, url in page.requests if url.endswith("/state.json"))
            assert polls >= 3
            assert not [line for line in page.console if "Content Security Policy" in line or "exception" in line], \
                page.console

        # JavaScript off: the server-rendered page says the same.
        async with headless_page(chromium, tmp_path / "profile-nojs", javascript=False) as plain:
            await plain.navigate(f"{origin}/")
            assert await plain.evaluate("document.getElementById('app').dataset.source") == "server"
            assert await plain.text("#phase") == "staging"
            rows = await plain.evaluate(_HOST_ROWS)
            assert [row[:2] for row in rows] == [["node-a", "0"], ["node-b", "1–2"]]
            assert "left" in (await plain.text("#window") or "")
        for agent in walk_ins:
            await agent.stream.aclose()
    finally:
        daemon.kill()
        await daemon.proc.wait()
