"""The status page's restarts section in a real headless chromium: the JavaScript twin renders what the
server HTML does (this attempt, n of at most N, and each earlier attempt's run, hosts and cause).

Skips without chromium, fails instead under FLODLD_REQUIRE_BROWSER=1 (what `.ci/run` sets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from flodld.controller.status.http import build_app
from flodld.controller.status.page import render_page
from flodld.controller.status.source import HttpAnswer
from flodld.controller.status.summary import attempt_texts, summarised
from tests.conftest import require_binary

from .cdp import headless_page

ATTEMPT = {
    "number": 2,
    "max_attempts": 3,
    "earlier": [
        {"number": 1, "run_id": "r1", "cause": "1 of 2 ranks failed <i>(ranks [1])</i>", "hosts": ["a", "b"]}
    ],
}
STATE: dict[str, Any] = {
    "phase": "training", "reason": "world formed", "run_id": "r2",
    "controller": "127.0.0.1:1", "joined_ranks": 2, "joined_hosts": 2, "quorum": 2, "target": 2,
    "window_remaining_secs": None, "cap_remaining_secs": None, "start_mode": "auto", "start_armed": False,
    "startable": False, "members": [], "missing": [], "refused": {}, "rank_exits": [], "attempt": ATTEMPT,
}  # fmt: skip
EXPECTED = [
    "attempt 2 of at most 3",
    "attempt 1 (run r1, hosts a, b) failed: 1 of 2 ranks failed <i>(ranks [1])</i>",
]


class _Fixed:
    def state_json(self) -> dict[str, Any] | None:
        return summarised(dict(STATE))  # as the run and the service add it to each build

    def metrics_text(self) -> str:
        return ""

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        return HttpAnswer(409, {"error": "no start switch", "code": "no_start_switch"})


def test_the_server_html_names_the_attempt_and_each_earlier_cause_as_text() -> None:
    assert attempt_texts(ATTEMPT) == EXPECTED
    page = render_page(STATE)
    assert "attempt 2 of at most 3" in page
    assert "&lt;i&gt;(ranks [1])&lt;/i&gt;" in page  # escaped: a cause is text, never markup
    assert attempt_texts(None) == [] and 'id="attempt"' not in render_page({**STATE, "attempt": None})


async def test_the_live_page_shows_the_attempts_as_the_server_html_does(tmp_path: Path) -> None:
    chromium = require_binary("browser", "chromium")
    runner = web.AppRunner(build_app(_Fixed()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with headless_page(chromium, tmp_path / "profile") as page:
            await page.navigate(f"http://127.0.0.1:{port}/status")
            await page.wait_for("document.getElementById('app').dataset.source === 'live'")
            assert await page.text("#attempt-number") == EXPECTED[0]
            assert await page.text("#attempt-earlier li") == EXPECTED[1]
            assert await page.evaluate("document.querySelectorAll('#attempt i').length") == 0
        async with headless_page(chromium, tmp_path / "profile-nojs", javascript=False) as plain:
            await plain.navigate(f"http://127.0.0.1:{port}/status")
            assert await plain.evaluate("document.getElementById('app').dataset.source") == "server"
            assert await plain.text("#attempt-number") == EXPECTED[0]
            assert await plain.text("#attempt-earlier li") == EXPECTED[1]
    finally:
        await runner.cleanup()
