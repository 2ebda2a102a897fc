"""The status page as a pure function of state.json: `render_page` (the whole document) and
`render_state` (its sections). The headline's wording is the summariser's (`summary.py`), which the
page's script and `fdl status` show too; the rows' wordings are `wording.py`'s.

One self-contained page: no external asset, no CDN, no build step. The server renders the whole state
into the HTML, escaping every value, so the page reads fine with JavaScript off (a `<noscript>` refresh
reloads it every few seconds). With JavaScript on, `/status.js` polls `/state.json` at most once a
second (every ten seconds while the tab is hidden), redraws the same sections from it, and ticks the
countdowns between polls. Serving it (routes, security headers, the assets) is
`flodld.controller.status.page_routes`.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flodld.controller.status.summary import (
    HISTORY_COLUMNS,
    MAX_HISTORY,
    MEMBER_COLUMNS,
    Summary,
    member_row,
    summarise,
)
from flodld.controller.status.wording import as_int, fmt_time

MAX_ROWS = 500  # hosts, missing names, rank exits rendered; the rest is a "N more" note (paging: issue 18)
MAX_TAIL_LINES = 40  # the root cause's output lines shown (state.json carries at most 40)
POLL_SECS = 1.0  # the fastest the page polls state.json (the "at most once per second per tab")
HIDDEN_POLL_SECS = 10.0
NOSCRIPT_REFRESH_SECS = 5
NO_STATE_TEXT = "no membership state published yet"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pct(part: float, whole: float) -> int:
    return max(0, min(100, round(100 * part / whole))) if whole > 0 else 0


def _more(count: int, noun: str) -> str:
    return f'<p class="more">{count} more {_e(noun)} not shown (the page lists the first {MAX_ROWS}).</p>'


def _not_shown(total: int, noun: str, shown: int = MAX_ROWS) -> str:
    """The "more not shown" line under a list of `total` entries of which `shown` are listed, or ''."""
    return _more(total - shown, noun) if total > shown else ""


def _entries(state: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """The objects listed under `key` (anything else there is skipped: the page never fails on them)."""
    return [entry for entry in (state.get(key) or []) if isinstance(entry, Mapping)]


def _head(state: Mapping[str, Any], words: Summary) -> str:
    phase = str(state.get("phase") or "?")
    return (
        f'<section id="head"><h1>run <span id="run-id">{_e(state.get("run_id") or "?")}</span></h1>'
        f'<p><span id="phase" class="phase phase-{_e(phase)}">{_e(phase)}</span> '
        f'<span class="note">{_e(words.note)}</span></p>'
        f'<p id="reason" class="reason">{_e(state.get("reason") or "")}</p>'
        f'<p class="meta">controller <span id="controller">{_e(state.get("controller") or "?")}</span>'
        f'{_service(words)}</p>{_config_error(state)}</section>'
    )


def _service(words: Summary) -> str:
    return f' · <span id="service">{_e(words.service)}</span>' if words.service else ""


def _config_error(state: Mapping[str, Any]) -> str:
    service = state.get("service")
    error = service.get("config_error") if isinstance(service, Mapping) else None
    if not error:
        return ""
    return (f'<p id="config-error" class="bad">config reload failed (the previous config stays in force): '
            f"{_e(error)}</p>")


def _clock(words: Summary) -> str:
    cells = (
        f'<div class="clock"><span class="label">{label}</span> <span id="{key}">{_e(text)}</span></div>'
        for key, label, text in (("window", "window", words.window), ("cap", "hard cap", words.cap))
    )
    return f'<section id="clock">{"".join(cells)}</section>'


def _ranks(state: Mapping[str, Any], words: Summary) -> str:
    joined, quorum = as_int(state.get("joined_ranks")), as_int(state.get("quorum"))
    scale = max(as_int(state.get("target")), quorum, joined, 1)
    fill = _pct(joined, scale)
    mark = _pct(quorum, scale)
    met = "met" if joined >= quorum else "short"
    return (
        f'<section id="ranks"><h2>ranks</h2><p id="rank-count">{_e(words.ranks)}</p>'
        f'<div class="bar {met}" role="img" aria-label="{joined} of {scale} ranks">'
        f'<div class="fill w{fill}"></div><div class="mark l{mark}" title="quorum"></div></div></section>'
    )


def _start(state: Mapping[str, Any], words: Summary) -> str:
    armed = "yes" if state.get("start_armed") else "no"
    cls = "go" if words.start_go else ""
    return (
        '<section id="start"><h2>start switch</h2><p id="start-text" '
        f'class="{cls}">{_e(words.start)}</p>'
        f'<p class="meta">mode <span id="start-mode">{_e(state.get("start_mode") or "auto")}</span>, '
        f'armed <span id="start-armed">{armed}</span></p></section>'
    )


def _member_total(state: Mapping[str, Any], listed: int) -> int:
    """How many hosts there are: state.json pages its member list (`members_page.total`)."""
    page = state.get("members_page")
    total = page.get("total") if isinstance(page, Mapping) else None
    if isinstance(total, int) and not isinstance(total, bool) and total >= listed:
        return total
    return listed


def _empty_section(section_id: str, title: str, message: str) -> str:
    """A section with nothing to list: its heading and `message` (constant text, not escaped)."""
    return f'<section id="{section_id}"><h2>{title}</h2><p class="empty">{message}</p></section>'


def _table_section(section_id: str, title: str, headers: Sequence[str], rows: str, more: str = "") -> str:
    """A section holding one table: `headers` and `title` are constant text (not escaped), `rows` its
    already escaped <tr> elements, `more` what follows the table (a "not shown" line, or nothing).
    """
    head = "".join(f"<th>{name}</th>" for name in headers)
    return (
        f'<section id="{section_id}"><h2>{title}</h2><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table>{more}</section>"
    )


def _hosts(state: Mapping[str, Any]) -> str:
    members = _entries(state, "members")
    if not members:
        return _empty_section("hosts", "hosts", "none joined yet")
    rows = []
    for member in members[:MAX_ROWS]:
        *cells, link = member_row(member)
        rows.append(
            "<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in cells)
            + f'<td class="link-{_e(link)}">{_e(link)}</td></tr>'
        )
    total = _member_total(state, len(members))
    shown = min(len(members), MAX_ROWS)
    more = _not_shown(total, "hosts", shown)
    return _table_section("hosts", f"hosts ({total})", MEMBER_COLUMNS, "".join(rows), more)


def _missing(state: Mapping[str, Any]) -> str:
    missing = [str(name) for name in (state.get("missing") or [])]
    if not missing:
        return _empty_section("missing", "missing", "nobody on the roster is missing")
    more = _not_shown(len(missing), "names")
    items = "".join(f"<li>{_e(name)}</li>" for name in missing[:MAX_ROWS])
    return (
        f'<section id="missing"><h2>missing ({len(missing)})</h2>'
        f'<ul class="names">{items}</ul>{more}</section>'
    )


def _refused(state: Mapping[str, Any]) -> str:
    refused = state.get("refused") or {}
    counts = sorted(((str(k), as_int(v)) for k, v in refused.items()), key=lambda kv: (-kv[1], kv[0]))
    if not counts:
        return _empty_section("refused", "refusals", "none")
    rows = "".join(f"<tr><td>{_e(code)}</td><td>{n}</td></tr>" for code, n in counts[:MAX_ROWS])
    return _table_section("refused", "refusals", ("reason", "count"), rows)


def _exits(state: Mapping[str, Any]) -> str:
    exits = _entries(state, "rank_exits")
    if not exits:
        return _empty_section("exits", "rank exits", "none reported")
    bad = sum(1 for x in exits if as_int(x.get("code")) != 0)
    rows = "".join(
        f'<tr><td>{as_int(x.get("rank"))}</td><td class="{"bad" if as_int(x.get("code")) else "ok"}">'
        f"{as_int(x.get('code'))}</td></tr>"
        for x in exits[:MAX_ROWS]
    )
    more = _not_shown(len(exits), "exits")
    return _table_section("exits", f"rank exits ({len(exits)}, {bad} non-zero)", ("rank", "code"), rows, more)


def _root_cause(state: Mapping[str, Any]) -> str:
    """The first observed failure (state.json's `root_cause`): summary, time, error and output tail."""
    cause = state.get("root_cause")
    if not isinstance(cause, Mapping):
        return ""
    tail = [str(line) for line in cause.get("tail") or []][-MAX_TAIL_LINES:]
    error = cause.get("error")
    return (
        '<section id="root-cause"><h2>root cause (first observed failure)</h2>'
        f'<p id="root-cause-summary" class="bad">{_e(cause.get("summary") or "")}</p>'
        f'<p class="meta">failed at {_e(fmt_time(cause.get("failed_at")))}</p>'
        + (f'<p id="root-cause-error">{_e(error)}</p>' if isinstance(error, str) and error else "")
        + (f'<pre id="root-cause-tail" class="tail">{_e(chr(10).join(tail))}</pre>' if tail else "")
        + "</section>"
    )


def _listed_section(
    state: Mapping[str, Any],
    key: str,
    title: str,
    headers: Sequence[str],
    row: Callable[[Mapping[str, Any]], str],
    more_noun: str | None = None,
) -> str:
    """A table of the objects state.json lists under `key` (also the section's id), one `row` each, at most
    `MAX_ROWS` (with the "not shown" line naming `more_noun`, if any); `title` formats with their count.
    Nothing when there are none.
    """
    entries = _entries(state, key)
    if not entries:
        return ""
    rows = "".join(row(entry) for entry in entries[:MAX_ROWS])
    more = _not_shown(len(entries), more_noun) if more_noun is not None else ""
    return _table_section(key, title.format(len(entries)), headers, rows, more)


def _rank_and_host(x: Mapping[str, Any]) -> str:
    return f"<td>{as_int(x.get('rank'))}</td><td>{_e(x.get('host') or '')}</td>"


def _round(x: Mapping[str, Any], unknown: str = "") -> str:
    return _e(unknown if x.get("round") is None else str(as_int(x.get("round"))))


def _loss_row(x: Mapping[str, Any]) -> str:
    return f'<tr>{_rank_and_host(x)}<td class="bad">{_e(x.get("cause") or "")}</td><td>{_round(x)}</td></tr>'


def _losses(state: Mapping[str, Any]) -> str:
    """Ranks the run lost (state.json's `losses`): rank, host, cause and the round it was in."""
    headers = ("rank", "host", "cause", "round")
    return _listed_section(state, "losses", "lost ranks ({})", headers, _loss_row, "losses")


def _join_row(x: Mapping[str, Any]) -> str:
    return f"<tr>{_rank_and_host(x)}<td>{_round(x, 'waiting')}</td></tr>"


def _joins(state: Mapping[str, Any]) -> str:
    """Ranks that walked in during training (state.json's `joins`): rank, host and the round it entered."""
    headers = ("rank", "host", "entered at round")
    return _listed_section(state, "joins", "walked-in ranks ({})", headers, _join_row, "joins")


def _delay(value: object) -> str:
    """A deposit delay to the millisecond: '0.051 s'."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return "—"
    return f"{float(value):.3f} s"


def _straggler_row(x: Mapping[str, Any]) -> str:
    return (
        f"<tr><td>{as_int(x.get('rank'))}</td><td>{_e(_delay(x.get('mean_delay_secs')))}</td>"
        f"<td>{_e(_delay(x.get('last_delay_secs')))}</td><td>{as_int(x.get('rounds'))}</td>"
        f"<td>{as_int(x.get('skipped', 0))}</td></tr>"
    )


def _stragglers(state: Mapping[str, Any]) -> str:
    """The slowest ranks (state.json's `stragglers`): how late their deposits reach the fold."""
    headers = ("rank", "mean delay", "last delay", "rounds", "skipped")
    return _listed_section(state, "stragglers", "slowest ranks", headers, _straggler_row)


def _attempt(words: Summary) -> str:
    """The run among its restarts: this attempt and each earlier one's cause."""
    texts = words.attempts
    if not texts:
        return ""
    earlier = "".join(f'<li class="bad">{_e(text)}</li>' for text in texts[1:])
    return (
        f'<section id="attempt"><h2>restarts</h2><p id="attempt-number">{_e(texts[0])}</p>'
        + (f'<ul id="attempt-earlier">{earlier}</ul>' if earlier else "")
        + "</section>"
    )


def _history(state: Mapping[str, Any], words: Summary) -> str:
    if words.history is None:
        return ""
    if not words.history:
        return _empty_section("history", "history", "no finished runs yet")
    rows = []
    for row in words.history:
        cells = [f"<td>{_e(cell)}</td>" for cell in row]
        cells[1] = f'<td class="phase phase-{_e(row[1])}">{_e(row[1])}</td>'  # the verdict, coloured
        rows.append(f"<tr>{''.join(cells)}</tr>")
    total = len(_entries(state, "history"))
    more = f'<p class="more">{total - MAX_HISTORY} older runs not shown.</p>' if total > MAX_HISTORY else ""
    return _table_section("history", f"history ({total})", HISTORY_COLUMNS, "".join(rows), more)


def render_state(state: Mapping[str, Any] | None) -> str:
    """The page's content for one state.json dict (None: no state yet). Every value is HTML-escaped."""
    if state is None:
        return (
            f'<section id="head"><h1>flodld</h1><p id="reason" class="reason">{NO_STATE_TEXT}</p></section>'
        )
    words = summarise(state)  # the headline's wording, as the script and `fdl status` show it
    parts = [_head(state, words), _attempt(words), _root_cause(state), _losses(state), _joins(state)]
    parts += [_clock(words), _ranks(state, words), _start(state, words)]
    parts.append(_hosts(state))
    parts.append(_missing(state))
    parts += ['<div class="cols">', _refused(state), _exits(state), "</div>", _stragglers(state)]
    parts.append(_history(state, words))
    return "".join(parts)


def render_page(state: Mapping[str, Any] | None) -> str:
    """The whole HTML document: server-rendered state, replaced live by /status.js when scripts run."""
    title = (
        f"flodld · {state.get('run_id') or '?'} · {state.get('phase') or '?'}" if state else "flodld status"
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{_e(title)}</title>"
        '<link rel="stylesheet" href="/status.css">'
        f'<noscript><meta http-equiv="refresh" content="{NOSCRIPT_REFRESH_SECS}"></noscript>'
        '<script src="/status.js" defer></script></head>'
        f'<body><main id="app" data-source="server">{render_state(state)}</main>'
        '<footer><span id="live">server-rendered; reload for fresh numbers</span> · '
        '<a href="/state.json">state.json</a> · <a href="/metrics">metrics</a></footer>'
        "</body></html>\n"
    )
