"""Serving the status page on the controller port: `GET /` (and `/status`), `/status.js`, `/status.css`,
with the headers that keep it read-only. The page itself is `flodld.controller.status.page` (a pure function
of state.json); its script and style are package data in flodld/controller/status/static.

Read-only by construction: the page carries no token, offers no start button and sends nothing but GETs
to its own origin. The Content-Security-Policy allows script and style only from the page's origin (no
inline code at all; widths are CSS classes, not style attributes), no framing, no forms, no base URL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING

from aiohttp import web

from flodld.controller.status.page import (
    HIDDEN_POLL_SECS,
    MAX_ROWS,
    MAX_TAIL_LINES,
    NO_STATE_TEXT,
    POLL_SECS,
    render_page,
)
from flodld.controller.status.snapshot import RenderRefused
from flodld.controller.status.summary import HISTORY_COLUMNS, MAX_HISTORY

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from flodld.controller.status.source import StatusSource

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
# No Access-Control-Allow-Origin: another origin's script cannot read the page or its assets.
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
PAGE_ENDPOINTS = ["GET /status", "GET /status.js", "GET /status.css"]


def _asset(name: str) -> str:
    """The page's script and style, package data in flodld/controller/status/static (loaded at import)."""
    return resources.files("flodld.controller.status").joinpath("static", name).read_text(encoding="utf-8")


def _width_classes() -> str:
    return "".join(f".w{i}{{width:{i}%}}.l{i}{{left:{i}%}}" for i in range(101))


STATUS_CSS = _asset("status.css") + _width_classes() + "\n"

# The client: plain JavaScript, DOM built with textContent only (never innerHTML), GET /state.json only.
_JS_TEMPLATE = _asset("status.js.in")


def _fill(template: str, values: Mapping[str, object]) -> str:
    """Put each `__NAME__` of the template in place (JSON-encoded: numbers, strings, objects)."""
    for name, value in values.items():
        template = template.replace(f"__{name}__", json.dumps(value))
    assert "__" not in template.replace("__proto__", ""), "a placeholder was left unfilled"
    return template


STATUS_JS = _fill(
    _JS_TEMPLATE,
    {
        "MAX_ROWS": MAX_ROWS,
        "MAX_HISTORY": MAX_HISTORY,
        "HISTORY_COLUMNS": list(HISTORY_COLUMNS),
        "MAX_TAIL_LINES": MAX_TAIL_LINES,
        "POLL_MS": int(POLL_SECS * 1000),
        "HIDDEN_MS": int(HIDDEN_POLL_SECS * 1000),
        "NO_STATE": NO_STATE_TEXT,
    },
)


def wants_html(request: web.Request) -> bool:
    """A browser asks for HTML (`Accept: text/html,...`); curl, `fdl status` and scripts do not."""
    return "text/html" in request.headers.get("Accept", "").lower()


def _respond(body: str, content_type: str) -> web.Response:
    return web.Response(
        text=body, content_type=content_type, charset="utf-8", headers={**SECURITY_HEADERS, "Vary": "Accept"}
    )


def busy_answer(refused: RenderRefused) -> web.Response:
    """429 for a reader past the render budget: what was spent, and when to ask again (Retry-After)."""
    return web.Response(
        status=429,
        text=json.dumps({"error": refused.detail, "code": "render_budget"}, separators=(",", ":")),
        content_type="application/json",
        headers={"Cache-Control": "no-cache", "Retry-After": str(refused.retry_after)},
    )


async def close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: every GET/HEAD answer closes its connection.

    The mux gives an HTTP connection a fixed lifetime (`HTTP_CONNECTION_SECS`); a browser tab polling
    state.json would otherwise keep one keep-alive connection open until the mux cut it (a
    `connection_http_lifetime` drop on the page's own refusal counters, and a failed poll when the
    cut lands mid-request). One read per connection keeps both away. The hook runs after aiohttp
    chose the Connection header, so the header is set here too: the client learns it must not reuse.
    POST answers keep aiohttp's default (no browser page ever POSTs here).
    """
    if request.method in ("GET", "HEAD"):
        response.force_close()
        response.headers["Connection"] = "close"


def add_routes(app: web.Application, source: StatusSource, root_json: Handler) -> None:
    """`GET /` and `/status` (the page), `/status.js`, `/status.css` (HEAD comes with each GET).

    `/` answers a browser with the page and everything else (curl, scripts written against the old
    alias) with `root_json`, the state.json handler; `/status` is always the page.
    """

    async def page(request: web.Request) -> web.Response:
        status_html = getattr(source, "status_html", None)
        if status_html is None:  # a source without the cache: rendered per request
            return _respond(render_page(source.state_json()), "text/html")
        try:
            body = status_html(request.remote or "?")  # one render per build, charged to the reader
        except RenderRefused as refused:
            return busy_answer(refused)
        return web.Response(
            body=body,
            content_type="text/html",
            charset="utf-8",
            headers={**SECURITY_HEADERS, "Vary": "Accept"},
        )

    async def root(request: web.Request) -> web.StreamResponse:
        if wants_html(request):
            return await page(request)
        response = await root_json(request)
        response.headers["Vary"] = "Accept"
        return response

    async def script(_: web.Request) -> web.Response:
        return _respond(STATUS_JS, "text/javascript")

    async def style(_: web.Request) -> web.Response:
        return _respond(STATUS_CSS, "text/css")

    app.router.add_get("/", root)
    app.router.add_get("/status", page)
    app.router.add_get("/status.js", script)
    app.router.add_get("/status.css", style)
