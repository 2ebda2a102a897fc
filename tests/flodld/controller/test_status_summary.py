"""One summariser of state.json (flodld/controller/status/summary.py): the status page, state.json's
`summary` (what the page's script shows) and `fdl status` word the headline and the finished runs alike,
for every state.

Before it, the three decided on their own: `fdl status` called a manual window "roster startable" on its
phase, "armed (forming at the next tick)", "waiting for quorum" without the counts, and its ranks line and
countdowns had their own words; the script kept a JavaScript copy of each wording.
"""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from typing import Any

import pytest
from fdl.status import render, render_history

from flodld.config.join import JoinConfig
from flodld.controller.status.page import render_page
from flodld.controller.status.page_routes import STATUS_JS
from flodld.controller.status.summary import HELD_NOTE, HISTORY_COLUMNS, Summary, summarise
from flodld.membership.snapshot import StateSnapshot, StatusSummary

from .agents import http, join, options, started

BASE: dict[str, Any] = {
    "phase": "waiting", "reason": "waiting for quorum: 1 of 3", "run_id": "r1", "controller": "h:1",
    "joined_ranks": 1, "joined_hosts": 1, "quorum": 3, "target": 4, "window_remaining_secs": 125.0,
    "cap_remaining_secs": 3720.0, "start_mode": "hybrid", "start_armed": False, "startable": False,
    "members": [], "missing": [], "refused": {}, "rank_exits": [],
}  # fmt: skip

STATES: dict[str, dict[str, Any]] = {
    "waiting": BASE,
    "startable": {**BASE, "phase": "staging", "joined_ranks": 3, "joined_hosts": 2, "startable": True},
    "armed": {**BASE, "phase": "staging", "joined_ranks": 3, "startable": True, "start_armed": True},
    "held": {
        **BASE, "phase": "staging", "start_mode": "manual", "window_remaining_secs": None, "target": None
    },
    "training": {
        **BASE, "phase": "training", "start_mode": "auto", "window_remaining_secs": None,
        "cap_remaining_secs": None, "joined_ranks": 4,
        "attempt": {"number": 2, "max_attempts": 3, "earlier": [
            {"number": 1, "run_id": "r0", "cause": "rank 1 <b>failed</b>", "hosts": ["a", "b"]}]},
    },
    "between runs": {
        **BASE, "phase": "done", "start_mode": "auto", "window_remaining_secs": None,
        "cap_remaining_secs": None,
        "service": {"runs_started": 2, "runs": {"done": 1, "failed": 1}, "between_runs": True,
                    "next_window_in_secs": 4.2, "config": None, "config_loaded_at": 1.0,
                    "config_error": None, "history_limit": 20},
        "history": [
            {"run_id": "s-2", "verdict": "failed", "reason": "1 of 2 ranks failed", "started_at": 1.7e9,
             "formed_at": 1.7e9 + 12.5, "ended_at": 1.7e9 + 754, "ranks": 2, "hosts": ["a", "b"],
             "host_count": 9,
             "rank_exits": [{"rank": 0, "code": 0}, {"rank": 1, "code": 3}],
             "root_cause": {"summary": "rank 1 on host 'b' (exit code 3): <i>boom</i>"},
             "attempt": {"number": 2, "max_attempts": 3, "earlier": [
                 {"number": 1, "run_id": "s-1", "cause": "host 'c' lost", "hosts": ["c"]}]}},
            {"run_id": "s-0", "verdict": "done", "reason": "every host link closed", "ended_at": None,
             "formed_at": None, "ranks": [0, 1], "hosts": [], "rank_exits": []},
        ],
    },
}  # fmt: skip


class _Cells(HTMLParser):
    """The text of each table cell (th and td), in order."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self._inside = False
        self.feed(document)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "th"):
            self.cells.append("")
            self._inside = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._inside = False

    def handle_data(self, data: str) -> None:
        if self._inside:
            self.cells[-1] += data


class _ById(HTMLParser):
    """The text of each element with an id (and of each `.note` span), as a browser shows it."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []
        self.feed(document)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        key = named.get("id") or ("note" if named.get("class") == "note" else None)
        if tag in ("meta", "link", "br"):
            return
        self._open.append(key)
        if key is not None:
            self.text.setdefault(key, "")

    def handle_endtag(self, tag: str) -> None:
        if self._open and tag not in ("meta", "link", "br"):
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for key in self._open:
            if key is not None:
                self.text[key] += data


@pytest.mark.parametrize("name", list(STATES))
def test_the_page_state_json_and_fdl_status_word_the_headline_alike(name: str) -> None:
    state = STATES[name]
    words = summarise(state)
    page = _ById(render_page(state)).text
    assert page["note"] == words.note and page["rank-count"] == words.ranks, page
    assert page["window"] == words.window and page["cap"] == words.cap, page
    assert page["start-text"] == words.start, page
    assert page.get("service", "") == words.service, page
    assert page.get("attempt-number") == (words.attempts[0] if words.attempts else None), page

    lines = render(state, "h:1").splitlines()
    assert lines[0].endswith(f"({words.note})"), lines
    assert f"  ranks: {words.ranks}" in lines, lines
    if state["phase"] in ("waiting", "staging"):
        assert f"  window: {words.window}   hard cap: {words.cap}" in lines, lines
        assert f"  start: {words.start}" in lines, lines
    assert [line.strip() for line in lines if line.strip().startswith("attempt ")] == list(words.attempts)
    if words.service:
        assert f"  {words.service}" in lines, lines

    # what the script shows: state.json's `summary`, valid against the schema of state.json
    served = StateSnapshot.model_validate({**state, "history": None, "summary": words.as_json()})
    assert served.summary == StatusSummary(**words.as_json())


def test_each_wording_once() -> None:
    assert summarise(STATES["waiting"]) == Summary(
        note="window open, quorum not met yet",
        ranks="1 joined across 1 host(s) — quorum 3, target 4",
        window="2m 05s left",
        cap="1h 02m left",
        start="hybrid — waiting for quorum (1 of 3 ranks)",
        start_go=False,
        attempts=(),
        service="",
        history=None,
    )
    assert summarise(STATES["startable"]).start == "hybrid — startable — fire with `fdl start`"
    assert summarise(STATES["startable"]).start_go
    assert summarise(STATES["armed"]).start == "hybrid — armed — forming at the next tick"
    held = summarise(STATES["held"])
    assert held.note == HELD_NOTE and held.window == "closed" and held.ranks.endswith("no target")
    assert held.start == "manual — waiting for quorum (1 of 3 ranks)"  # not startable: the window says
    assert summarise(STATES["training"]).attempts == (
        "attempt 2 of at most 3",
        "attempt 1 (run r0, hosts a, b) failed: rank 1 <b>failed</b>",
    )
    assert summarise(STATES["between runs"]).service == (
        "service: run 2 · 1 done, 1 failed · between runs — next window in 4s"
    )
    assert summarise(STATES["between runs"]).history == (
        (
            "s-2", "failed", "2023-11-14 22:25:54Z", "+12.5s", "12m 34s", "2", "a, b +7 more", "rank 1: 3",
            "[attempt 2/3] 1 of 2 ranks failed — root cause: rank 1 on host 'b' (exit code 3): <i>boom</i>"
            " — after attempt 1 failed: host 'c' lost",
        ),
        ("s-0", "done", "—", "never", "—", "2", "—", "—", "every host link closed"),
    )
    assert summarise({**BASE, "history": []}).history == () and summarise(BASE).history is None


def test_the_page_and_fdl_status_list_the_finished_runs_alike() -> None:
    """Before, `fdl status --history` had its own columns and words ("2x 0", "a,b,… (9 hosts)", local
    start times) and the page showed no attempt of a restarted run.
    """
    state = STATES["between runs"]
    words = summarise(state)
    assert words.history is not None
    document = render_page(state)
    section = document.split('<section id="history">', 1)[1].split("</section>", 1)[0]
    cells = _Cells(section).cells
    assert cells[: len(HISTORY_COLUMNS)] == list(HISTORY_COLUMNS)
    assert cells[len(HISTORY_COLUMNS) :] == [cell for row in words.history for cell in row]
    table = render_history(state).splitlines()
    assert table[0].split() == [word for column in HISTORY_COLUMNS for word in column.upper().split()]
    for line, row in zip(table[1:], words.history, strict=True):
        assert [cell.strip() for cell in line.split("  ") if cell.strip()] == list(row), (line, row)


def test_fdl_status_takes_startable_from_the_window_not_from_the_phase() -> None:
    """A manual window in staging that the window does not call startable (here: armed and cleared, as
    an older controller could show it) is not offered to `fdl start` by fdl status either.
    """
    state = {**BASE, "phase": "staging", "start_mode": "manual", "joined_ranks": 3, "startable": False}
    text = render(state, "h:1")
    assert "startable" not in text and "start: manual — waiting for quorum (3 of 3 ranks)" in text


@pytest.mark.parametrize(
    "junk",
    [{}, {"phase": 3, "joined_ranks": "x", "target": True, "attempt": [], "service": "up"},
     {"window_remaining_secs": True, "service": {"runs": 7, "between_runs": True}}],
)  # fmt: skip
def test_a_malformed_state_is_worded_never_raised_on(junk: dict[str, Any]) -> None:
    words = summarise(junk)
    assert words.ranks.startswith("0 joined across 0 host(s)") and words.window == "closed"
    assert words.start.startswith("auto — ")


def test_the_script_words_no_headline_and_no_finished_run_itself() -> None:
    for wording in (
        "window still open", "held until", "fire with", "forming at the next", "joined across", "exited 0",
        "root cause: ", "+ \" more\"", "[attempt ",
    ):
        assert wording not in STATUS_JS, wording
    assert "s.summary" in STATUS_JS


def test_fdl_status_loads_the_summariser_without_the_controller() -> None:
    heavy = ("aiohttp", "flodld.controller.run", "flodld.controller.status.http")
    code = (
        "import sys, json; from fdl.status import render; "
        f"render(json.loads({json.dumps(json.dumps(STATES['training']))}), 'h:1'); "
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout) == [], (done.stdout, done.stderr)


async def test_a_live_controller_serves_the_summary_of_its_own_state() -> None:
    controller, port = await started(options(capacity=3, join=JoinConfig(start="manual", min_rank_start=2)))
    try:
        status, state = await http(port, "GET", "/state.json")
        assert status == 200 and state["summary"]["start"] == "manual — waiting for quorum (0 of 2 ranks)"
        agent = await join(port, controller.salt, "node-a", devices=2)
        status, state = await http(port, "GET", "/state.json")
        assert status == 200 and state["phase"] == "staging", state
        assert state["summary"] == summarise(state).as_json()
        assert state["summary"]["start"] == "manual — startable — fire with `fdl start`"
        assert state["summary"]["start_go"] is True
        await agent.leave()
    finally:
        await controller.close()
