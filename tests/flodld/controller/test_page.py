"""The status page: the server-rendered fallback (every value escaped), history rendering, and the
security headers of `/`, `/status`, `/status.js`, `/status.css` on a live controller port.

The page in a real browser: tests/browser/test_status_page.py.
"""

from __future__ import annotations

import asyncio
import json
from html.parser import HTMLParser
from typing import Any

from flodld.config.join import JoinConfig
from flodld.controller.status.page import MAX_ROWS, render_page
from flodld.controller.status.page_routes import CONTENT_SECURITY_POLICY, STATUS_JS
from flodld.controller.status.summary import start_text
from flodld.controller.status.wording import duration_secs, exits_summary, fmt_ranks, fmt_secs

from .agents import join, options, started


class _Elements(HTMLParser):
    """Every start tag with its attributes, and the text of the document."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(document)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def by_id(self, ident: str) -> dict[str, str | None]:
        return next(attrs for _, attrs in self.tags if attrs.get("id") == ident)


def _state(**changes: object) -> dict[str, Any]:
    state: dict[str, Any] = {
        "phase": "staging",
        "reason": "staging: 3 ranks in, quorum 3 met",
        "run_id": "r1",
        "controller": "10.0.0.1:1337",
        "joined_ranks": 3,
        "joined_hosts": 2,
        "quorum": 3,
        "target": 6,
        "window_remaining_secs": 125.4,
        "cap_remaining_secs": 3725.0,
        "start_mode": "hybrid",
        "start_armed": False,
        "startable": True,
        "members": [
            {
                "host": "node-a",
                "ranks": [0],
                "devices": ["cuda:0"],
                "device_labels": ["H100"],
                "variant": "cu124",
                "joined_at_secs": 1.7,
                "link": "open",
            },
            {
                "host": "node-b",
                "ranks": [1, 2],
                "devices": ["cpu:0", "cpu:1"],
                "device_labels": [],
                "variant": "cpu",
                "joined_at_secs": 12.2,
                "link": "lost",
            },
        ],
        "missing": ["gpu-node-7"],
        "refused": {"bad_token": 2, "duplicate_host": 5},
        "rank_exits": [{"rank": 0, "code": 0}, {"rank": 1, "code": -9}],
        "connections": {"by_channel": {}, "dropped": {}},
    }
    state.update(changes)
    return state


HOSTILE = '"><script>alert(1)</script><img src=x onerror=alert(2)>&amp;'


def test_the_fallback_shows_every_part_of_the_state() -> None:
    page = _Elements(render_page(_state()))
    text = " ".join(page.text)
    for expected in (
        "staging",
        "quorum met, window still open",
        "staging: 3 ranks in, quorum 3 met",
        "2m 05s left",
        "1h 02m left",
        "quorum 3, target 6",
        "hybrid — startable — fire with `fdl start`",
        "node-a",
        "1× H100",
        "cu124",
        "+1s",
        "1–2",
        "cpu:0, cpu:1",
        "lost",
        "gpu-node-7",
        "duplicate_host",
        "rank exits (2, 1 non-zero)",
        "-9",
    ):
        assert expected in text, expected
    assert text.index("duplicate_host") < text.index("bad_token")  # refusals by count, largest first
    assert page.by_id("phase")["class"] == "phase phase-staging"
    assert page.by_id("app")["data-source"] == "server"
    bar = next(
        attrs for tag, attrs in page.tags if tag == "div" and (attrs.get("class") or "").startswith("bar")
    )
    assert bar["class"] == "bar met"
    assert ("div", {"class": "fill w50"}) in page.tags and (
        "div",
        {"class": "mark l50", "title": "quorum"},
    ) in page.tags
    assert not any(attrs.get("id") == "history" for _, attrs in page.tags)  # no history without the service


def test_every_value_is_escaped_in_the_fallback() -> None:
    hostile_member = {
        "host": HOSTILE,
        "ranks": [0],
        "devices": [HOSTILE],
        "device_labels": [],
        "variant": HOSTILE,
        "joined_at_secs": 0,
        "link": HOSTILE,
    }
    state = _state(
        phase=HOSTILE,
        reason=HOSTILE,
        run_id=HOSTILE,
        controller=HOSTILE,
        start_mode=HOSTILE,
        members=[hostile_member],
        missing=[HOSTILE],
        refused={HOSTILE: 1},
        history=[{"run_id": HOSTILE, "verdict": HOSTILE, "reason": HOSTILE, "ended_at": HOSTILE}],
    )
    document = render_page(state)
    assert "<script>alert" not in document and "<img" not in document and '"><script' not in document
    page = _Elements(document)
    scripts = [attrs for tag, attrs in page.tags if tag == "script"]
    assert scripts == [{"src": "/status.js", "defer": None}]  # the only script, from our origin
    assert not [tag for tag, _ in page.tags if tag in ("img", "iframe", "form", "object", "embed", "base")]
    assert not [(tag, name) for tag, attrs in page.tags for name in attrs if name.startswith("on")]
    assert not [attrs for _, attrs in page.tags if "style" in attrs]  # nothing inline for the CSP to allow
    text = "".join(page.text)
    assert text.count(HOSTILE) >= 8  # shown as text, verbatim, in each place
    assert page.by_id("phase")["class"] == f"phase phase-{HOSTILE}"  # an attribute value, never markup


def test_no_state_yet_and_a_closed_window() -> None:
    page = _Elements(render_page(None))
    assert "no membership state published yet" in page.text
    closed = " ".join(
        _Elements(
            render_page(
                _state(
                    phase="training",
                    window_remaining_secs=None,
                    cap_remaining_secs=None,
                    start_mode="manual",
                    startable=False,
                    members=[],
                    missing=[],
                    refused={},
                    rank_exits=[],
                )
            )
        ).text
    )
    assert "closed" in closed and "none joined yet" in closed and "nobody on the roster is missing" in closed
    assert "manual — window closed" in closed and "none reported" in closed


def test_a_manual_hold_past_the_window_expiry_is_not_called_open() -> None:
    held = " ".join(
        _Elements(render_page(_state(start_mode="manual", window_remaining_secs=None, target=None))).text
    )
    assert "window still open" not in held
    assert "quorum met, window expired: held until `fdl start` (or the hard cap)" in held
    assert "1h 02m left" in held  # the hard cap still counts down
    # The script words nothing of the headline itself: it shows state.json's `summary` (summary.py).
    assert "held until" not in STATUS_JS and "window still open" not in STATUS_JS
    assert "startable" not in STATUS_JS and "words.note" in STATUS_JS and "words.start" in STATUS_JS


def _cpu_member(index: int) -> dict[str, Any]:
    """A state.json member: host h<INDEX> with rank INDEX on one CPU, link open."""
    return {
        "host": f"h{index}",
        "ranks": [index],
        "devices": ["cpu:0"],
        "device_labels": [],
        "variant": "cpu",
        "joined_at_secs": 0,
        "link": "open",
    }


def test_long_lists_are_cut_with_a_note() -> None:
    members = [_cpu_member(i) for i in range(MAX_ROWS + 7)]
    page = _Elements(render_page(_state(members=members, missing=[f"m{i}" for i in range(MAX_ROWS + 3)])))
    assert (
        sum(1 for tag, _ in page.tags if tag == "tr") == (MAX_ROWS + 1) + 3 + 3
    )  # hosts, refusals, exits (+ heads)
    text = " ".join(page.text)
    assert (
        f"hosts ({MAX_ROWS + 7})" in text
        and "7 more hosts not shown" in text
        and "3 more names not shown" in text
    )


def test_a_paged_member_list_shows_the_world_total() -> None:
    """state.json lists the first page of members (`members_page`); the page counts the whole world."""
    members = [_cpu_member(i) for i in range(MAX_ROWS)]
    state = _state(members=members)
    state["members_page"] = {"start": 0, "stop": MAX_ROWS, "total": 5000}
    text = " ".join(_Elements(render_page(state)).text)
    assert "hosts (5000)" in text and f"{5000 - MAX_ROWS} more hosts not shown" in text


def test_history_and_service_of_a_long_running_daemon_are_rendered_when_state_has_them() -> None:
    history = [  # RunRecord, as `flodld serve` (the service) publishes it, newest first
        {
            "run_id": "sweep-2",
            "verdict": "failed",
            "reason": "window expired: quorum not met",
            "started_at": 1_700_000_800,
            "formed_at": None,
            "ended_at": 1_700_000_842.9,
            "ranks": 0,
            "hosts": [],
            "rank_exits": [],
        },
        {
            "run_id": "sweep-1",
            "verdict": "done",
            "reason": "every host link closed cleanly",
            "started_at": 1_700_000_000,
            "formed_at": 1_700_000_012.5,
            "ended_at": 1_700_000_754,
            "ranks": 8,
            "hosts": [f"n{i}" for i in range(8)],
            "rank_exits": [{"rank": r, "code": 0 if r != 3 else 1} for r in range(8)],
        },
    ]
    service = {
        "runs_started": 3,
        "runs": {"done": 1, "failed": 1},
        "between_runs": True,
        "next_window_in_secs": 4.2,
        "config": "/etc/flodld/fdl.yml",
        "config_loaded_at": 1_700_000_000,
        "config_error": "ConfigError: <bad>",
        "history_limit": 50,
    }
    document = render_page(_state(history=history, service=service))
    page = _Elements(document)
    section = document.split('<section id="history">', 1)[1].split("</section>", 1)[0]
    rows = " | ".join(_Elements(section).text)  # the history table's cells, in order
    assert "history (2)" in rows
    assert (
        "sweep-2 | failed | 2023-11-14 22:27:22Z | never | 42.9s | 0 | — | — | window expired: quorum not met"
        in rows
    )
    assert (
        "sweep-1 | done | 2023-11-14 22:25:54Z | +12.5s | 12m 34s | 8 | n0, n1, n2, n3, n4, n5 +2 more | "
        "rank 3: 1 | every host link closed cleanly"
    ) in rows
    assert ("td", {"class": "phase phase-failed"}) in page.tags
    text = " ".join(page.text)
    assert "service: run 3 · 1 done, 1 failed · between runs — next window in 4s" in text
    assert "config reload failed (the previous config stays in force): ConfigError: <bad>" in text
    assert "&lt;bad&gt;" in document
    empty = " ".join(_Elements(render_page(_state(history=[]))).text)
    assert "no finished runs yet" in empty and "service:" not in empty
    assert exits_summary([{"rank": 0, "code": 0}, {"rank": 1, "code": 0}]) == "all 2 exited 0"


def test_formatters() -> None:
    assert [fmt_secs(v) for v in (0, 59.9, 60, 3599, 3600, -3, None, True)] == [
        "0s",
        "59s",
        "1m 00s",
        "59m 59s",
        "1h 00m",
        "0s",
        "—",
        "—",
    ]
    assert fmt_ranks([7, 0, 1, 2, 3, 9, 10]) == "0–3, 7, 9–10" and fmt_ranks([]) == "—"
    assert duration_secs({"started_at": 10, "ended_at": 25.5}) == 15.5 and duration_secs({}) is None
    assert exits_summary([]) == "—" and exits_summary({"0": 0, "1": 0}) == "all 2 exited 0"
    assert start_text({"start_mode": "auto"}).startswith("auto — the window closes by itself")
    assert (
        start_text({"start_mode": "manual", "start_armed": True})
        == "manual — armed — forming at the next tick"
    )
    assert start_text({"start_mode": "hybrid", "phase": "waiting", "joined_ranks": 1, "quorum": 3}) == (
        "hybrid — waiting for quorum (1 of 3 ranks)"
    )


def test_the_script_builds_text_nodes_and_only_gets() -> None:
    assert (
        "innerHTML" not in STATUS_JS
        and "outerHTML" not in STATUS_JS
        and "insertAdjacentHTML" not in STATUS_JS
    )
    assert "eval(" not in STATUS_JS and "document.write" not in STATUS_JS
    assert 'fetch("/state.json", {method: "GET"' in STATUS_JS and STATUS_JS.count("fetch(") == 1
    assert "token" not in STATUS_JS.lower() and "/start" not in STATUS_JS
    assert "POLL_MS = 1000" in STATUS_JS  # at most once a second per tab


async def _get(
    port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One request without `Connection: close`, as a browser sends it: the server must close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"] + [
        f"{k}: {v}" for k, v in (headers or {}).items()
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    answer = await asyncio.wait_for(reader.read(), 3)  # returns only because the server closes
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    first, *rest = head.decode().split("\r\n")
    fields = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in rest)
    }
    return int(first.split(" ", 2)[1]), fields, body


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


async def test_page_routes_carry_the_security_headers_and_root_negotiates() -> None:
    controller, port = await started(options(capacity=2, join=JoinConfig(start="manual")))
    try:
        agent = await join(port, controller.salt, "<b>node</b>")
        answers = {
            "/status": await _get(port, "/status"),
            "/ (browser)": await _get(port, "/", BROWSER),
            "/status.js": await _get(port, "/status.js"),
            "/status.css": await _get(port, "/status.css"),
        }
        types = {path: fields["content-type"] for path, (_, fields, _) in answers.items()}
        assert types == {
            "/status": "text/html; charset=utf-8",
            "/ (browser)": "text/html; charset=utf-8",
            "/status.js": "text/javascript; charset=utf-8",
            "/status.css": "text/css; charset=utf-8",
        }
        for path, (status, fields, _) in answers.items():
            assert status == 200, path
            assert fields["content-security-policy"] == CONTENT_SECURITY_POLICY, path
            assert (
                fields["x-content-type-options"] == "nosniff" and fields["referrer-policy"] == "no-referrer"
            ), path
            assert (
                fields["x-frame-options"] == "DENY"
                and fields["cross-origin-resource-policy"] == "same-origin"
            )
            assert "access-control-allow-origin" not in fields, path  # no CORS at all on the page
            assert fields["connection"] == "close", path
        csp = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
        assert (
            csp["default-src"] == "'none'" and csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
        )
        assert (
            csp["connect-src"] == "'self'"
            and csp["frame-ancestors"] == "'none'"
            and csp["form-action"] == "'none'"
        )
        assert "unsafe" not in CONTENT_SECURITY_POLICY and "*" not in CONTENT_SECURITY_POLICY
        page = answers["/status"][2].decode()
        assert "&lt;b&gt;node&lt;/b&gt;" in page and "<b>node</b>" not in page
        assert controller.salt_hex not in page and controller.start_credential not in page
        assert answers["/status.js"][2].decode() == STATUS_JS

        # Anything that is not a browser asking for HTML gets state.json at `/`, as before the page.
        status, fields, body = await _get(port, "/", {"Accept": "*/*"})
        assert (
            status == 200
            and fields["content-type"].startswith("application/json")
            and fields["vary"] == "Accept"
        )
        assert json.loads(body)["members"][0]["host"] == "<b>node</b>"
        status, fields, body = await _get(port, "/state.json")  # unchanged, but it closes like every answer
        assert (
            status == 200 and fields["connection"] == "close" and fields["access-control-allow-origin"] == "*"
        )
        status, fields, body = await _get(port, "/status", method="HEAD")
        assert status == 200 and body == b"" and fields["content-security-policy"] == CONTENT_SECURITY_POLICY
        status, _, body = await _get(port, "/nope")
        assert status == 404 and "GET /status" in json.loads(body)["endpoints"]
        await agent.stream.aclose()
    finally:
        await controller.close()


ROOT_CAUSE = {
    "host": "walk-a",
    "rank": 1,
    "code": 1,
    "exit": "exit code 1",
    "failed_at": 1_765_000_000.25,
    "error": "RuntimeError: boom " + HOSTILE,
    "tail": ["[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: boom " + HOSTILE],
    "summary": "rank 1 on host 'walk-a' (exit code 1): RuntimeError: boom",
    "failed_ranks": 4,
    "consequences": 2,
}


def test_the_root_cause_heads_a_failed_run_and_follows_its_history_entry() -> None:
    document = render_page(
        _state(
            phase="failed",
            root_cause=ROOT_CAUSE,
            history=[
                {
                    "run_id": "r0",
                    "verdict": "failed",
                    "reason": "1 of 4 ranks failed",
                    "root_cause": ROOT_CAUSE,
                }
            ],
        )
    )
    elements = _Elements(document)
    text = "".join(elements.text)
    assert elements.by_id("root-cause") is not None and elements.by_id("root-cause-tail") is not None
    assert "root cause (first observed failure)" in text
    assert "rank 1 on host 'walk-a' (exit code 1): RuntimeError: boom" in text
    assert "[rank1]: Traceback (most recent call last):" in text and "2025-12-06 05:46:40Z" in text
    assert "1 of 4 ranks failed — root cause: rank 1 on host 'walk-a'" in text  # the history row
    assert "<script>alert" not in document and "<img src=x" not in document  # escaped
    assert document.index('id="root-cause"') < document.index('id="clock"')  # at a glance: first


def test_no_root_cause_no_section_and_the_script_renders_one() -> None:
    assert 'id="root-cause"' not in render_page(_state())
    assert 'h("section", {id: "root-cause"}' in STATUS_JS and "words.history" in STATUS_JS


def test_lost_ranks_are_listed_with_host_cause_and_round_and_the_script_renders_them() -> None:
    assert 'id="losses"' not in render_page(_state())
    losses = [
        {"rank": 1, "host": "node-a", "cause": "exited with signal 9", "round": 3, "at_secs": 5.0},
        {"rank": 4, "host": "<script>", "cause": "lost with its host: reset", "round": None, "at_secs": 6.0},
    ]
    html = render_page(_state(losses=losses))
    page = _Elements(html)
    assert page.by_id("losses") is not None
    text = "".join(page.text)
    assert "lost ranks (2)" in text and "exited with signal 9" in text and "<script>" in text
    assert "<td>&lt;script&gt;</td>" in html  # escaped: never markup
    assert 'h("section", {id: "losses"}' in STATUS_JS


def test_walked_in_ranks_are_listed_with_the_round_they_entered_and_the_script_renders_them() -> None:
    assert 'id="joins"' not in render_page(_state())
    joins = [
        {"rank": 3, "host": "node-c", "round": 12, "at_secs": 40.0},
        {"rank": 4, "host": "<b>", "round": None, "at_secs": 41.0},
    ]
    html = render_page(_state(joins=joins))
    page = _Elements(html)
    assert page.by_id("joins") is not None
    text = "".join(page.text)
    assert "walked-in ranks (2)" in text and "node-c" in text and "waiting" in text
    assert "<td>&lt;b&gt;</td>" in html  # escaped: never markup
    assert 'h("section", {id: "joins"}' in STATUS_JS


def test_the_slowest_ranks_are_shown_to_the_millisecond_and_the_script_renders_them() -> None:
    assert 'id="stragglers"' not in render_page(_state())
    slow = [{"rank": 5, "mean_delay_secs": 0.8125, "last_delay_secs": 1.5, "rounds": 12}]
    page = _Elements(render_page(_state(stragglers=slow)))
    assert page.by_id("stragglers") is not None
    text = "".join(page.text)
    assert "slowest ranks" in text and "0.812 s" in text and "1.500 s" in text
    assert 'h("section", {id: "stragglers"}' in STATUS_JS
    # The rounds that closed without a rank (straggler_timeout) are a column of their own.
    skipped = [{**slow[0], "skipped": 3}]
    html = render_page(_state(stragglers=skipped))
    assert "<th>skipped</th>" in html and "<td>12</td><td>3</td>" in html
    assert 'h("th", {}, "skipped")' in STATUS_JS and "int(x.skipped)" in STATUS_JS
