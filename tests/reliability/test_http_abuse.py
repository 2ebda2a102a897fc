"""The HTTP surface under hostile requests, and the POST /start credential check from non-loopback peers."""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from flodld.controller.status.http import build_app
from tests.conftest import require_capability

from .daemon import (
    hello,
    http_raw,
    http_request,
    json_of,
    non_loopback_address,
    options,
    raw_join,
    running,
    state,
)
from .daemon import status_of as status

MANUAL = JoinConfig(join_timeout=60, min_rank_start=1, start="manual")
HOSTILE = {
    "smuggle-cl-te": b"POST /start HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nGET /state.json HTTP/1.1\r\nHost: t\r\n\r\n",
    "smuggle-two-cl": b"POST /start HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\n"
    b"GET /state.json HTTP/1.1\r\nHost: t\r\n\r\n",
    "smuggle-te-obfuscated": b"POST /start HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: xchunked\r\n\r\n",
    "obs-fold": b"GET /state.json HTTP/1.1\r\nHost: t\r\nX: a\r\n b\r\n\r\n",
    "oversize-header": b"GET /state.json HTTP/1.1\r\nHost: t\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n",
    "oversize-uri": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
    "header-count": b"GET /state.json HTTP/1.1\r\nHost: t\r\n"
    + b"".join(b"X-%d: 1\r\n" % i for i in range(5000))
    + b"\r\n",
    "nul-in-header": b"GET /state.json HTTP/1.1\r\nHost: t\x00x\r\n\r\n",
    "invalid-utf8-path": b"GET /\xff\xfe HTTP/1.1\r\nHost: t\r\n\r\n",
    "bare-lf": b"GET /state.json HTTP/1.1\nHost: t\n\n",
    "space-before-colon": b"GET /state.json HTTP/1.1\r\nHost : t\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_malformed_and_smuggling_requests_get_one_400_and_the_connection_closes(
    request_bytes: bytes,
) -> None:
    async with running(options(join=MANUAL)) as (_, port):
        response = await http_raw(port, request_bytes, timeout=3)
        assert status(response) == 400, response[:120]
        assert len(re.findall(rb"(?m)^HTTP/1\.[01] \d{3} ", response)) == 1, "a smuggled request was answered"
        body = await state(port)  # and the daemon still serves
        assert body["start_armed"] is False


async def test_malformed_requests_are_counted_and_logged_as_one_line_without_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with running(options(join=MANUAL)) as (controller, port):
        for request_bytes in HOSTILE.values():
            await http_raw(port, request_bytes, timeout=3)
        with_token = f"POST /start?token={controller.salt_hex}\x00 HTTP/1.1\r\nHost: t\r\n\r\n".encode()
        assert status(await http_raw(port, with_token, timeout=3)) == 400
        body = await state(port)
        refused_lines = [r for r in caplog.records if "event=http_refused" in r.getMessage()]
    malformed = len(HOSTILE) + 1
    assert body["connections"]["dropped"]["http_malformed"] == malformed
    assert len(refused_lines) == malformed
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in refused_lines)
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "peer=127.0.0.1 status=400" in refused_lines[-1].getMessage()
    assert "token=<redacted>" in refused_lines[-1].getMessage()
    assert controller.salt_hex not in caplog.text


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("PUT", "/start", None),
        ("DELETE", "/state.json", None),
        ("PATCH", "/", None),
        ("OPTIONS", "/", None),
        ("POST", "/state.json", 404),
        ("GET", "/start", 404),
        ("GET", "/../../etc/passwd", 404),
        ("HEAD", "/", 200),
    ],
)
async def test_unsupported_methods_are_dropped_or_refused_and_never_change_state(
    method: str, path: str, expected: int | None
) -> None:
    async with running(options(join=MANUAL)) as (_, port):
        response = await http_raw(port, http_request(method, path), timeout=3)
        if expected is None:
            assert response == b"", "a method outside GET/POST/HEAD reaches no HTTP handler: the mux drops it"
        else:
            assert status(response) == expected
        body = await state(port)
        assert body["start_armed"] is False
        if expected is None:
            assert body["refused"].get("connection_unknown_magic") == 1


async def test_an_oversized_body_or_absurd_content_length_is_answered_at_once_and_never_arms_the_switch() -> (
    None
):
    async with running(options(join=MANUAL)) as (_, port):
        # With the header of a local CLI, so the body limits (not the start header check) answer.
        big = await http_raw(
            port, http_request("POST", "/start", {"X-Flodld-Start": "1"}, body=b"x" * 200_000), timeout=3
        )
        assert status(big) in (409, 413)
        claim = (
            b"POST /start HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Flodld-Start: 1\r\n"
            b"Content-Length: 99999999999\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(claim)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert status(head) in (409, 413)
        writer.close()
        assert (await state(port))["start_armed"] is False


async def _non_loopback_start(port: int, address: str, token: str | None) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return await http_raw(port, http_request("POST", "/start", headers), host=address)


async def test_post_start_from_a_non_loopback_address_needs_the_run_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = non_loopback_address()
    require_capability(
        "nonloopback",
        address is not None,  # FLODLD_REQUIRE_NONLOOPBACK=1: fail
        "no non-loopback IPv4 address here; the injected-peer test below covers the handler",
    )
    assert address is not None
    caplog.set_level(logging.INFO)
    async with running(options(bind_host="0.0.0.0", join=MANUAL)) as (controller, port):
        agent = await raw_join(port, controller.salt)
        agent.write(agent.conn.send_message(hello("a")))
        await agent.next_message()
        wrong = "0" * 32 if controller.salt_hex != "0" * 32 else "1" * 32
        for token, code in [
            (None, "missing_token"),
            (wrong, "bad_token"),
            ("", "missing_token"),
            (controller.salt_hex[:-1], "bad_token"),
            ("x" * 5000, "bad_token"),
            (controller.salt_hex, "join_token"),
        ]:  # the salt is never the start credential
            response = await _non_loopback_start(port, address, token)
            assert status(response) == 403, (token, response[:200])
            assert json_of(response)["code"] == code
            assert controller.salt_hex not in response.decode(errors="replace")
        assert (await state(port))["start_armed"] is False
        response = await _non_loopback_start(port, address, controller.start_credential.upper())
        assert status(response) == 200 and json_of(response)["armed"] is True
        # The public-peer warning is checked with a peer that is public on every machine:
        # test_cleartext_peer_netns.py (this machine's own address may well be private).
        agent.close()


def _remote_peer(address: str) -> Middleware:
    @web.middleware
    async def rewrite(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=address))

    return rewrite


@asynccontextmanager
async def _app_seen_from(controller: Controller, peer: str) -> AsyncIterator[int]:
    """The controller's real HTTP app on its own port, every request appearing to come from `peer`."""
    app = build_app(controller)
    app.middlewares.append(_remote_peer(peer))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.Server)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("peer", ["203.0.113.9", "10.1.2.3", "::ffff:8.8.8.8", "fe80::1%eth0", "unix-socket"])
async def test_the_start_handler_treats_every_non_loopback_peer_as_remote(peer: str) -> None:
    async with running(options(join=MANUAL)) as (controller, _), _app_seen_from(controller, peer) as port:
        refused = await http_raw(port, http_request("POST", "/start"))
        assert status(refused) == 403 and json_of(refused)["code"] == "missing_token"
        salt = await http_raw(port, http_request("POST", f"/start?token={controller.salt_hex}"))
        assert status(salt) == 403 and json_of(salt)["code"] == "join_token"
        allowed = await http_raw(port, http_request("POST", f"/start?token={controller.start_credential}"))
        assert status(allowed) == 409 and json_of(allowed)["code"] == "quorum_not_met"


async def test_start_refusal_time_does_not_depend_on_how_much_of_the_token_matched() -> None:
    """A statistical sanity check, not a side-channel proof: a per-character early exit costing even
    tens of microseconds would show as a median gap; we allow noise of a shared 2-core machine.
    """
    async with (
        running(options(join=MANUAL)) as (controller, _),
        _app_seen_from(controller, "203.0.113.9") as port,
    ):
        secret = controller.start_credential
        nothing = "".join("0" if c != "0" else "1" for c in secret)
        almost = secret[:-1] + ("0" if secret[-1] != "0" else "1")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        samples: dict[str, list[float]] = {"nothing": [], "almost": []}
        try:
            for round_index in range(240):
                label = "nothing" if round_index % 2 == 0 else "almost"
                token = nothing if label == "nothing" else almost
                request = (
                    f"POST /start?token={token} HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
                ).encode()
                begun = loop.time()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                await reader.readexactly(length)
                samples[label].append(loop.time() - begun)
                assert status(head) == 403
        finally:
            writer.close()
        median_nothing = statistics.median(samples["nothing"][20:])
        median_almost = statistics.median(samples["almost"][20:])
        gap = abs(median_almost - median_nothing)
        assert gap < max(0.0005, 0.3 * min(median_nothing, median_almost)), (median_nothing, median_almost)
