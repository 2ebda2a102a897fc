"""The status page's root-cause section in a real headless chromium: the JavaScript twin renders what the
server HTML does (summary, exception, output tail, the history row's reason), from a fixed state.json.

Skips without chromium, fails instead under FLODLD_REQUIRE_BROWSER=1 (what `.ci/run` sets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from flodld.controller.status.http import build_app
from flodld.controller.status.source import HttpAnswer
from flodld.controller.status.summary import summarised
from tests.conftest import require_binary

from .cdp import headless_page

CAUSE = {
    "host": "walk-a",
    "rank": 1,
    "code": -15,
    "exit": "signal 15",
    "failed_at": 1_765_000_000.25,
    "error": "RuntimeError: rank 1 fails <b>on purpose</b>",
    "tail": [
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: RuntimeError: rank 1 fails <b>on purpose</b>",
    ],
    "summary": "rank 1 on host 'walk-a' (signal 15): RuntimeError: rank 1 fails <b>on purpose</b>",
    "failed_ranks": 4,
    "consequences": 2,
}
STATE: dict[str, Any] = {
    "phase": "failed", "reason": "1 of 4 ranks failed (ranks [2]), over the tolerance of 0", "run_id": "r2",
    "controller": "127.0.0.1:1", "joined_ranks": 4, "joined_hosts": 2, "quorum": 4, "target": 4,
    "window_remaining_secs": None, "cap_remaining_secs": None, "start_mode": "auto", "start_armed": False,
    "startable": False, "members": [], "missing": [], "refused": {},
    "rank_exits": [{"rank": 1, "code": -15}, {"rank": 2, "code": 1}], "root_cause": CAUSE,
    "history": [{"run_id": "r1", "verdict": "failed", "reason": "1 of 4 ranks failed", "root_cause": CAUSE}],
}  # fmt: skip


class _Fixed:
    def state_json(self) -> dict[str, Any] | None:
        return summarised(dict(STATE))  # as the run and the service add it to each build

    def metrics_text(self) -> str:
        return ""

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        return HttpAnswer(409, {"error": "no start switch", "code": "no_start_switch"})


async def test_the_live_page_shows_the_root_cause_as_the_server_html_does(tmp_path: Path) -> None:
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
            assert await page.text("#root-cause-summary") == CAUSE["summary"]  # as text: never markup
            assert await page.text("#root-cause-error") == CAUSE["error"]
            assert (await page.text("#root-cause-tail") or "").split("\n") == CAUSE["tail"]
            assert "failed at 2025-12-06 05:46:40Z" in (await page.text("#root-cause .meta") or "")
            assert await page.evaluate("document.querySelectorAll('#root-cause b').length") == 0
            reason = await page.evaluate("document.querySelector('#history tbody tr').lastChild.innerText")
            assert reason == "1 of 4 ranks failed — root cause: " + str(CAUSE["summary"])
        async with headless_page(chromium, tmp_path / "profile-nojs", javascript=False) as plain:
            await plain.navigate(f"http://127.0.0.1:{port}/status")
            assert await plain.evaluate("document.getElementById('app').dataset.source") == "server"
            assert await plain.text("#root-cause-summary") == CAUSE["summary"]
            assert (await plain.text("#root-cause-tail") or "").split("\n") == CAUSE["tail"]
    finally:
        await runner.cleanup()
