"""POST /start refuses web pages (issue 13, point 12), against a real `flodld serve`.

A browser request (Origin, Sec-Fetch-*) is refused whatever it carries; a loopback caller must send
`X-Flodld-Start: 1`, which a page cannot send cross-site without a preflight, and preflights get no
CORS grant; no answer to a POST carries a wildcard Access-Control-Allow-Origin.
"""

from __future__ import annotations

import json

import pytest

from flodld.wire.salt import new_salt, salt_from_hex

from .agents import join
from .daemon_proc import start_daemon
from .starthttp import START, arm_and_finish, credential, raw, stop

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    "browser",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
        {"Origin": "http://127.0.0.1:1337", "Sec-Fetch-Site": "same-origin"},  # DNS rebinding looks like this
    ],
    ids=["cross-site-origin", "opaque-origin", "sec-fetch", "rebound-same-origin"],
)
async def test_a_browser_request_never_fires_the_start(browser: dict[str, str]) -> None:
    token = new_salt().hex()
    daemon = await start_daemon("--ranks", "1", "--token", token, "--start", "manual", "--window", "20")
    try:
        agent = await join(daemon.port, salt_from_hex(token), "a")  # quorum met: only the start is missing
        # Even with the header a page could only send after a preflight, and even with the credential.
        for extra in ({}, START, {**START, "Authorization": f"Bearer {credential(token)}"}):
            status, fields, body = await raw(daemon.port, "POST", "/start", {**browser, **extra})
            assert (status, json.loads(body)["code"]) == (403, "browser_request")
            assert not any(name.startswith("access-control-") for name in fields), fields
        _, _, body = await raw(daemon.port, "GET", "/state.json")
        assert json.loads(body)["phase"] == "staging"  # not armed, not forming
        await agent.stream.aclose()
    finally:
        await stop(daemon)


async def test_a_simple_loopback_post_without_the_start_header_is_refused_and_preflights_get_no_cors() -> (
    None
):
    token = new_salt().hex()
    daemon = await start_daemon("--ranks", "1", "--token", token, "--start", "manual", "--window", "20")
    try:
        agent = await join(daemon.port, salt_from_hex(token), "a")
        # What a cross-site <form method=post> (or fetch no-cors) sends when the browser adds no Origin.
        status, fields, body = await raw(
            daemon.port, "POST", "/start", {"Content-Type": "application/x-www-form-urlencoded"}
        )
        answer = json.loads(body)
        assert (status, answer["code"]) == (403, "missing_token") and "X-Flodld-Start: 1" in answer["error"]
        assert "access-control-allow-origin" not in fields  # no wildcard CORS on POST
        status, fields, _ = await raw(daemon.port, "OPTIONS", "/start", {
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-flodld-start",
        })  # fmt: skip
        assert status in (0, 403) and not any(name.startswith("access-control-") for name in fields)
        await arm_and_finish(daemon, agent, START)  # what `fdl start` sends
    finally:
        daemon.kill()
