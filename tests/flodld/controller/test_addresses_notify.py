"""Private-range classification, the once-per-peer cleartext warning, sd_notify, IPv6 binds."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from flodld.controller.addresses import CleartextWarner, is_private_address
from flodld.controller.kvstate import KeyValueState, StoreFull
from flodld.controller.notify import SystemdNotifier
from tests.conftest import require_capability

from .agents import join, options, started


@pytest.mark.parametrize(
    ("address", "private"),
    [
        ("127.0.0.1", True), ("10.1.2.3", True), ("172.16.0.1", True), ("172.32.0.1", False),
        ("192.168.1.1", True), ("169.254.3.4", True), ("100.64.0.1", True), ("100.127.255.255", True),
        ("100.128.0.1", False), ("8.8.8.8", False), ("0.0.0.0", False), ("::1", True), ("fe80::1%eth0", True),
        ("fd12::1", True), ("2001:db8::1", False), ("::ffff:10.0.0.1", True), ("::ffff:8.8.8.8", False),
        ("not-an-ip", False),
    ],
)
def test_private_ranges(address: str, private: bool) -> None:
    assert is_private_address(address) is private


def test_cleartext_warning_is_logged_once_per_public_peer(caplog: pytest.LogCaptureFixture) -> None:
    warner = CleartextWarner("controller")
    with caplog.at_level(logging.WARNING):
        assert warner.check("8.8.8.8") is True
        assert warner.check("8.8.8.8") is False
        assert warner.check("10.0.0.1") is False
        assert warner.check("1.1.1.1") is True
    lines = [r.getMessage() for r in caplog.records if "cleartext_peer" in r.getMessage()]
    assert len(lines) == 2 and "CLEARTEXT" in lines[0] and "8.8.8.8" in lines[0]


def test_sd_notify_reaches_path_and_abstract_sockets() -> None:
    abstract = f"@flodld-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + abstract[1:])
        receiver.settimeout(2)
        assert SystemdNotifier(abstract).ready("listening") is True
        message = receiver.recv(4096).decode()
        assert message.startswith("READY=1\nSTATUS=listening") and f"MAINPID={os.getpid()}" in message
    assert SystemdNotifier("").ready("x") is False  # no NOTIFY_SOCKET: a no-op
    assert SystemdNotifier("/nonexistent/notify.sock").status("x") is False  # failures never raise


def test_store_budget_is_enforced_before_storing() -> None:
    state = KeyValueState(max_bytes=100)
    state.set("a", b"x" * 50)
    with pytest.raises(StoreFull, match="budget of 100 bytes"):
        state.set("b", b"y" * 60)
    assert state.get("b") is None
    state.set("a", b"z" * 90)  # replacing a value counts only the difference
    assert state.delete("a") and state.size_bytes == 0


async def test_ipv6_loopback_bind_serves_joins_and_names_the_controller_in_brackets() -> None:
    require_capability("ipv6", socket.has_ipv6, "no IPv6 on this machine")  # FLODLD_REQUIRE_IPV6=1: fail
    try:
        controller, port = await started(options(bind_host="::1", advertised_host="::1", capacity=1))
    except OSError as error:
        require_capability("ipv6", False, f"cannot bind ::1 here: {error}")
        raise
    try:
        agent = await join(port, controller.salt, "v6", address="::1")
        world = await agent.world()
        assert world.envelope.controller_host == "::1"
        assert controller.state_json()["controller"] == f"[::1]:{port}"  # type: ignore[index]
        await agent.leave()
    finally:
        await controller.close()
