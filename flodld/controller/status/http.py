"""The HTTP surface on the controller port: state.json, Prometheus metrics, POST /start, the status page.

The mux hands HTTP connections here (see `PortMux.set_http`). Everything the app answers comes
from a `StatusSource`, so the app holds no run state and is up before the window opens.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from flodld.controller.addresses import is_loopback_address
from flodld.controller.status.page_routes import PAGE_ENDPOINTS, add_routes, busy_answer, close_after_answer
from flodld.controller.status.snapshot import BadMembersQuery, RenderRefused, parse_members
from flodld.controller.status.source import StatusSource

log = logging.getLogger("flodld.controller.status.http")

ENDPOINTS = ["GET /", "GET /state.json", "GET /metrics", "POST /start", *PAGE_ENDPOINTS]
NO_STATE = "no membership state published yet"
# Read-only answers may be read from any page (dashboards); nothing that changes state is CORS-readable.
_HEADERS = {"Cache-Control": "no-cache", "Access-Control-Allow-Origin": "*"}
_POST_HEADERS = {"Cache-Control": "no-cache"}
# A local caller proves it is not a browser page by this header: a page cannot send it cross-site
# without a CORS preflight, and every preflight is refused.
START_HEADER = "X-Flodld-Start"
_BROWSER_HEADERS = ("Origin", "Sec-Fetch-Site", "Sec-Fetch-Mode")


_CREDENTIAL = re.compile(r"(?i)(token=|bearer\s+)[^\s&'\"\\]+")


def _redact_credentials(text: str) -> str:
    """Parser messages quote the offending line, which may carry `?token=` or a Bearer header."""
    return _CREDENTIAL.sub(r"\1<redacted>", text)


class HttpRefusalLog:
    """The logger aiohttp's request handler reports to, made fit for a port that faces the internet.

    A malformed request (smuggling attempt, oversize header, bad characters: aiohttp's parser
    answers it 400 and closes) becomes one counted warning line naming the peer and the reason,
    instead of an ERROR with a parser traceback per request, which a flood would turn into a
    log-volume attack. Anything else (a fault in our handlers) keeps its full traceback.
    """

    def __init__(self, dropped: Counter[str], logger: logging.Logger | None = None) -> None:
        self.dropped = dropped
        self.logger = logger or logging.getLogger("flodld.controller.status.http")

    def exception(
        self,
        message: str,
        *args: object,
        exc_info: BaseException | bool | None = None,
        **kwargs: Any,  # noqa: ANN401  logging.Logger.error's keywords, passed on
    ) -> None:
        if isinstance(exc_info, HttpProcessingError):
            peer = args[0] if args else "?"
            reason = _redact_credentials(" ".join(str(exc_info.message).split()))[:200]
            self.dropped["http_malformed"] += 1
            self.logger.warning("event=http_refused peer=%s status=%d reason=%r", peer, exc_info.code, reason)
            return
        self.logger.error(message, *args, exc_info=exc_info or True, **kwargs)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401  debug/info/warning/error as the real logger has them
        return getattr(self.logger, name)


def presented_token(request: web.Request) -> str | None:
    """The token from `?token=` or an `Authorization: Bearer` header (query wins)."""
    token = request.query.get("token")
    if token:
        return token
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def _json(status: int, body: dict[str, Any], headers: dict[str, str] = _HEADERS) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(body, separators=(",", ":")), content_type="application/json",
        headers=headers,
    )


def browser_marks(request: web.Request) -> list[str]:
    """The headers only a browser sends (Origin, Sec-Fetch-*): a page, not the CLI or curl."""
    return [name for name in _BROWSER_HEADERS if name in request.headers]


def build_app(source: StatusSource) -> web.Application:
    """The aiohttp application; serve it through the mux with `AppRunner(app).server`."""

    async def state(request: web.Request) -> web.Response:
        try:
            members = parse_members(request.query.get("members"))
        except BadMembersQuery as error:
            return _json(400, {"error": str(error), "code": "bad_members"})
        state_body = getattr(source, "state_body", None)
        if state_body is None:  # a source without the cache: the whole state, encoded per request
            snapshot = source.state_json()
            return _json(503, {"error": NO_STATE}) if snapshot is None else _json(200, snapshot)
        try:
            body = state_body(members, request.remote or "?")
        except RenderRefused as refused:
            return busy_answer(refused)
        if body is None:
            return _json(503, {"error": NO_STATE})
        return web.Response(status=200, body=body, content_type="application/json", headers=_HEADERS)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=source.metrics_text().encode(),
            headers={**_HEADERS, "Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def start(request: web.Request) -> web.Response:
        marks = browser_marks(request)
        if marks:
            # A web page (cross-site, or same-origin after DNS rebinding) never starts a run, whatever it
            # holds.
            log.warning("event=start_refused code=browser_request headers=%s", ",".join(marks))
            return _json(
                403,
                {
                    "error": f"start refused: a browser request ({', '.join(marks)} sent) cannot fire the "
                    "start; use `fdl start` or curl with -H 'X-Flodld-Start: 1'",
                    "code": "browser_request",
                },
                _POST_HEADERS,
            )
        loopback = request.remote is not None and is_loopback_address(request.remote)
        cli = loopback and request.headers.get(START_HEADER, "").strip() == "1"
        token = presented_token(request)
        # A credential that is presented is always checked, even where none is needed: a local CLI that
        # sends a wrong (stale, mistyped, another run's) credential is told so rather than armed anyway.
        local = cli and token is None
        answer = source.request_start(local=local, token=token)
        body = answer.body
        if loopback and not cli and body.get("code") == "missing_token":
            body = {
                **body,
                "error": f"start refused: a loopback caller must send the header '{START_HEADER}: 1' "
                "(`fdl start` does; curl: -H 'X-Flodld-Start: 1') or the start credential",
            }
        elif cli and body.get("code") == "bad_token":
            body = {
                **body,
                "error": "start refused: the start credential presented is not this run's (each run has its "
                "own; a stale or mistyped --token / $FDL_START_TOKEN is refused even on the controller host) "
                "— drop the token to start from this host, or pass the current run's credential",
            }
        return _json(answer.status, body, _POST_HEADERS)

    async def preflight(_: web.Request) -> web.Response:
        # No Access-Control-Allow-* at all: a browser never sends the real request.
        return web.Response(status=403, headers=_POST_HEADERS)

    async def not_found(request: web.Request) -> web.Response:
        headers = _HEADERS if request.method in ("GET", "HEAD") else _POST_HEADERS
        return _json(404, {"error": "not found", "endpoints": ENDPOINTS}, headers)

    app = web.Application(client_max_size=64 * 1024)
    app.on_response_prepare.append(close_after_answer)
    add_routes(app, source, root_json=state)  # GET / (page for a browser, else state.json), /status, assets
    app.router.add_get("/state.json", state)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/start", start)
    app.router.add_route("OPTIONS", "/{tail:.*}", preflight)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
