"""The HTTP surface on the controller port: every route and every POST /start refusal."""

from __future__ import annotations

import asyncio
import socket

from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from flodld.membership.snapshot import StateSnapshot
from tests.conftest import require_capability

from .agents import http, join, options, started

START = {"X-Flodld-Start": "1"}  # what `fdl start` sends: a loopback caller that is not a web page


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (so a connection to it is not 'local')."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, only a route is chosen
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_before_the_window_opens_state_is_503_and_start_has_no_state() -> None:
    controller = Controller(options(capacity=1, join=JoinConfig(start="manual")))
    _, port = await controller.listen()
    try:
        assert await http(port, "GET", "/state.json") == (503, {"error": "no membership state published yet"})
        status, body = await http(port, "POST", "/start", START)
        assert (status, body["code"]) == (503, "no_state")
    finally:
        await controller.close()


async def test_routes_root_alias_metrics_and_json_404() -> None:
    controller, port = await started(options(capacity=1))
    try:
        root, state = await http(port, "GET", "/"), await http(port, "GET", "/state.json")
        assert root[0] == state[0] == 200 and root[1]["run_id"] == state[1]["run_id"] == "test-run"
        StateSnapshot.model_validate(state[1])
        for method, path in (("GET", "/start"), ("POST", "/state.json"), ("GET", "/nope")):
            status, body = await http(port, method, path)
            assert status == 404 and body["error"] == "not found" and "POST /start" in body["endpoints"]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /state.json HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 3)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        await controller.close()


async def test_start_refusals_in_order_switch_mode_token() -> None:
    no_switch = Controller(options(capacity=1, start_switch=False, join=JoinConfig(start="manual")))
    assert no_switch.request_start(local=True, token=None).body["code"] == "no_start_switch"
    auto = Controller(options(capacity=1))
    answer = auto.request_start(local=False, token=None)
    assert (answer.status, answer.body["code"]) == (409, "auto_mode")  # mode is checked before credentials
    manual, port = await started(options(capacity=1, join=JoinConfig(start="manual")))
    try:
        missing = manual.request_start(local=False, token=None)
        bad = manual.request_start(local=False, token="ab" * 16)
        assert (missing.status, missing.body["code"]) == (403, "missing_token")
        assert (bad.status, bad.body["code"]) == (403, "bad_token")
        assert manual.salt_hex not in str(bad.body)
        salt = manual.request_start(local=False, token=manual.salt_hex)
        assert (salt.status, salt.body["code"]) == (403, "join_token")  # the salt is not the start credential
        good = manual.request_start(local=False, token=manual.start_credential.upper())
        assert (good.status, good.body["code"]) == (409, "quorum_not_met")  # past the credential check
        agent = await join(port, manual.salt, "a")
        armed = manual.request_start(local=False, token=manual.start_credential)
        assert armed.status == 200 and armed.body["armed"] is True
        await agent.world()
        await agent.leave()
    finally:
        await manual.close()


async def test_remote_post_start_needs_the_token_in_query_or_bearer_header() -> None:
    address = _non_loopback_address()
    require_capability("nonloopback", address is not None,  # FLODLD_REQUIRE_NONLOOPBACK=1: fail
                       "this machine has no non-loopback address to play a remote caller")
    assert address is not None
    controller, _ = await started(options(bind_host="0.0.0.0", capacity=1, join=JoinConfig(start="hybrid")))
    assert controller.address is not None
    port = controller.address[1]

    async def post(path: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
        return await http(port, "POST", path, headers, address=address)

    try:
        assert (await post("/start"))[0] == 403
        assert (await post("/start?token=" + "0" * 32))[1]["code"] == "bad_token"
        assert (await post(f"/start?token={controller.salt_hex}"))[1]["code"] == "join_token"
        assert (await post("/start", START))[1]["code"] == "missing_token"  # the header is for loopback only
        assert (await post(f"/start?token={controller.start_credential}"))[1]["code"] == "quorum_not_met"
        status, body = await post("/start", {"Authorization": f"Bearer {controller.start_credential}"})
        assert (status, body["code"]) == (409, "quorum_not_met")
    finally:
        await controller.close()
