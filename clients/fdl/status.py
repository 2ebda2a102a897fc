"""`fdl status [--json] [--addr host[:port]] [--watch] [--history] [--members A..B|all]`: the run's state from
the controller port.

state.json lists one page of hosts (the first 500 unless `--members` asks for others) and counts them all
(`member_counts`); past `LISTED_HOSTS` hosts the pretty form prints the counts and the first hosts only.

Against a `flodld serve` service the state also carries the finished runs (`history`, newest first): the
pretty form names the previous run's verdict while the next window waits, `--history` prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import webbrowser
from typing import Any, TextIO

from fdl.address import Candidates, format_address, resolve_candidates
from fdl.cli import Command
from fdl.endpoint import request

WINDOW_PHASES = ("waiting", "staging")
END_PHASES = ("done", "failed")
_COLOURS = {"training": "32", "done": "32", "waiting": "33", "staging": "33", "forming": "33", "failed": "31"}
LISTED_HOSTS = 50
NO_RUN_HINT = (
    "The status endpoint lives on the controller's port: for the daemon's whole life under `flodld serve`, "
    "for exactly as long as the run does under `fdl run` — a refused connection usually just means no "
    "controller is up."
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print state.json verbatim")
    parser.add_argument("--addr", help="controller host[:port] (bare host gets :1337)")
    parser.add_argument("--watch", action="store_true", help="refresh until the run ends")
    parser.add_argument(
        "--history", action="store_true", help="print the finished runs of a `flodld serve` service"
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between --watch refreshes")
    parser.add_argument(
        "--open",
        action="store_true",
        help="print the status page's URL and open it in a browser when a display is available",
    )
    parser.add_argument(
        "--members",
        metavar="A..B",
        help="list hosts A to B (inclusive, admission order) or `all`, instead of the first page",
    )
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


class NoRun(Exception):
    """Nothing answered 200 at any candidate."""


def fetch_state(candidates: Candidates, members: str | None = None) -> tuple[str, bytes]:
    """(address that answered, state.json body); NoRun with the last error otherwise."""
    last = "no candidates"
    path = "/state.json" if not members else f"/state.json?members={members}"
    for host, port in candidates.addresses:
        try:
            reply = request(host, port, "GET", path)
        except OSError as error:
            last = str(error) or repr(error)
            continue
        if reply.status == 200:
            return format_address(host, port), reply.body
        last = f"endpoint answered {reply.status} {reply.reason} — {reply.body.decode(errors='replace')}"
    raise NoRun(f"no run listening at {candidates.describe()} ({candidates.origin}): {last}\n{NO_RUN_HINT}")


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


def render(state: dict[str, Any], address: str, *, colour: bool = False, list_all: bool = False) -> str:
    """The pretty form of state.json (`list_all`: every host of the page, as `--members` asked)."""
    from flodld import api  # the summariser is pure: no controller (aiohttp) loads with it

    words = api.summarise(state)  # the headline in the page's words (flodld/controller/status/summary.py)
    phase = str(state.get("phase", "?"))
    lines = [
        f"run {state.get('run_id') or '?'} @ {address} — {_paint(phase, _COLOURS.get(phase, '0'), colour)}"
        + (f" ({words.note})" if words.note else "")
    ]
    lines.append(f"  ranks: {words.ranks}")
    if phase in WINDOW_PHASES:
        lines.append(f"  window: {words.window}   hard cap: {words.cap}")
        if state.get("start_mode", "auto") != "auto":
            lines.append(f"  start: {words.start}")
    members = [m for m in state.get("members") or [] if isinstance(m, dict)]
    page = state.get("members_page") if isinstance(state.get("members_page"), dict) else None
    total = int(page.get("total", len(members))) if page else len(members)
    shown = members if list_all else members[:LISTED_HOSTS]
    if not members and not total:
        lines.append("  hosts: none joined yet")
    else:
        raw_counts = state.get("member_counts")
        counts: dict[str, Any] = raw_counts if isinstance(raw_counts, dict) else {}
        if total > len(shown):
            summary = "; ".join(
                f"{what} " + ", ".join(f"{k} {v}" for k, v in (counts.get(key) or {}).items())
                for what, key in (("links", "by_link"), ("variants", "by_variant"), ("devices", "by_vendor"))
                if counts.get(key)
            )
            lines.append(f"  hosts: {total}" + (f" ({summary})" if summary else ""))
        first = int(page.get("start", 0)) if page else 0
        if shown:
            lines.append(
                "  hosts:"
                if total <= len(shown)
                else f"  hosts {first}..{first + len(shown) - 1} of {total} "
                "(more: fdl status --members A..B):"
            )
        width = max((len(m["host"]) for m in shown), default=0)
        for m in shown:  # each host in the page's words (flodld/controller/status/summary.py member_row)
            host, ranks, devices, variant, joined, link = api.member_row(m)
            name = _paint(host.ljust(width), "1", colour)
            state_of_link = "" if link == "open" else f"  link {link}"
            lines.append(
                f"    {name}  ranks {ranks}  {devices}  variant {variant}  joined {joined}{state_of_link}"
            )
    missing = state.get("missing") or []
    if missing:
        lines.append(f"  missing: {', '.join(missing)}")
    if state.get("reason"):
        lines.append(f"  reason: {state['reason']}")
    lines += [f"  {line}" for line in words.attempts[:1]] + [f"    {line}" for line in words.attempts[1:]]
    cause = state.get("root_cause")
    if isinstance(cause, dict):  # the first observed failure, across hosts
        lines += ["  " + line for line in _root_cause_lines(cause, tail_lines=ROOT_CAUSE_TAIL_LINES)]
    lines += _service_lines(state, words.service)
    return "\n".join(lines)


def _service_lines(state: dict[str, Any], headline: str) -> list[str]:
    """`flodld serve`: its runs (between runs: when the next window opens), the previous run (and its root
    cause), a failed config reload.
    """
    lines: list[str] = [f"  {headline}"] if headline else []
    service = state.get("service") or {}
    history = [h for h in (state.get("history") or []) if isinstance(h, dict)]
    if history and not service.get("between_runs"):
        last = history[0]
        lines.append(
            f"  previous run: {last.get('run_id')} {last.get('verdict')} {_ago(last.get('ended_at'))}"
            + (f" — {last['reason']}" if last.get("reason") else "")
        )
        if isinstance(last.get("root_cause"), dict) and last["root_cause"].get("summary"):
            lines.append(f"  previous run's root cause: {last['root_cause']['summary']}")
    if service.get("config_error"):
        lines.append(f"  config reload failed (previous config in force): {service['config_error']}")
    return lines


ROOT_CAUSE_TAIL_LINES = 20
"""Output lines of the failed rank `fdl status` shows (state.json has up to 40; --json prints them all)."""


def _root_cause_lines(cause: dict[str, Any], *, tail_lines: int) -> list[str]:
    from flodld import api  # only when a run failed: `fdl status` stays light otherwise

    return list(api.root_cause_lines(cause, tail_lines=tail_lines))


def _ago(when: object) -> str:
    if not isinstance(when, int | float):
        return ""
    seconds = max(0.0, time.time() - float(when))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(when)))
    return f"at {stamp} ({seconds:.0f}s ago)"


def render_history(state: dict[str, Any]) -> str:
    """The finished runs as a table, newest first, every one, in the status page's words."""
    from flodld import api

    if "history" not in state:
        return "no run history here (a single run: `fdl run` or `flodld serve --once`)"
    rows = [tuple(column.upper() for column in api.HISTORY_COLUMNS), *api.history_rows(state)]
    if len(rows) == 1:
        return "no finished runs yet"
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )


def _print_state(body: bytes, address: str, args: argparse.Namespace, out: TextIO) -> dict[str, Any] | None:
    if args.json:
        out.write(body.decode(errors="replace").rstrip("\n") + "\n")
    try:
        import json

        state = json.loads(body)
    except ValueError:
        if not args.json:
            out.write(body.decode(errors="replace") + "\n")
        return None
    if not args.json and isinstance(state, dict):
        if getattr(args, "history", False):
            out.write(render_history(state) + "\n")
        else:
            out.write(
                render(state, address, colour=out.isatty(), list_all=bool(getattr(args, "members", None)))
                + "\n"
            )
    return state if isinstance(state, dict) else None


def page_url(address: str) -> str:
    """The status page of the controller at `address` (host:port, [v6]:port)."""
    return f"http://{address}/status"


def display_available() -> bool:
    """A graphical browser can open here: macOS, Windows, or an X11/Wayland display in the environment."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


OPEN_WAIT_SECS = 2.0


def open_in_browser(url: str, wait: float = OPEN_WAIT_SECS) -> bool:
    """Hand `url` to the user's browser without ever blocking: `webbrowser` may run a browser that only
    returns when it exits ($BROWSER, a console browser), so it runs in a daemon thread that we wait on
    for at most `wait` seconds. False when the hand-off failed.
    """
    result: list[bool] = []

    def hand_off() -> None:
        try:
            result.append(bool(webbrowser.open(url, new=2)))
        except Exception:  # a broken browser setup must not fail `fdl status`
            result.append(False)

    thread = threading.Thread(target=hand_off, name="fdl-open-browser", daemon=True)
    thread.start()
    thread.join(wait)
    return result[0] if result else True  # still running after `wait`: the browser started and kept going


def _open(candidates: Candidates, out: TextIO) -> int:
    try:
        address, _ = fetch_state(candidates)
    except NoRun as error:
        print(f"fdl status: {error}", file=sys.stderr)
        return 1
    url = page_url(address)
    out.write(url + "\n")
    out.flush()
    if not display_available():
        print("fdl status: no display here: open the URL above in a browser", file=sys.stderr)
    elif not open_in_browser(url):
        print("fdl status: could not start a browser: open the URL above", file=sys.stderr)
    return 0


def main(args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        candidates = resolve_candidates(args.addr, getattr(args, "env", None), args.project, "status")
    except ValueError as error:
        print(f"fdl status: {error}", file=sys.stderr)
        return 2
    if getattr(args, "open", False):
        return _open(candidates, out)
    seen: str | None = None  # the last phase shown
    while True:
        try:
            address, body = fetch_state(candidates, getattr(args, "members", None))
        except NoRun as error:
            if seen is not None and args.watch:
                print(
                    f"fdl status: the run has ended (the controller port closed before its verdict could "
                    f"be shown; last seen: {seen}; the launcher's output or the daemon's log has it)",
                    file=sys.stderr,
                )
                return 0
            print(f"fdl status: {error}", file=sys.stderr)
            return 1
        if args.watch and out.isatty():
            out.write("\033[H\033[2J")
        state = _print_state(body, address, args, out)
        seen = str(state.get("phase") or "?") if state is not None else "?"
        out.flush()
        if not args.watch or (state is not None and state.get("phase") in END_PHASES):
            return 0
        time.sleep(max(0.05, args.interval))


COMMAND = Command("status", "show the run's membership state", __doc__, configure_parser, main)
