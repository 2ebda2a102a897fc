"""The controller's public-peer warning, proven with a peer that really is public whatever this host is.

A network namespace behind a veth pair gets an address in 198.18.0.0/15 (outside every private range
flodld knows); it dials the controller's network bind. The controller must log one
`event=cleartext_peer` naming that address, and none for a loopback peer. (The start-switch test in
test_http_abuse.py uses this machine's own outbound address, which is public only on some machines.)
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator

import pytest

from tests.hosts import netns

from .daemon import http_raw, http_request, options, running

pytestmark = pytest.mark.netns


@pytest.fixture
def public_namespace() -> Iterator[tuple[str, str, str]]:
    with netns.far_namespace("flpub", 233, public=True) as lab:
        yield lab


async def test_a_public_peer_is_warned_about_once_by_address_and_a_loopback_peer_never(
    public_namespace: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    namespace, _, near_address = public_namespace
    far_address = near_address.rsplit(".", 1)[0] + ".2"
    caplog.set_level(logging.WARNING)
    async with running(options(bind_host="0.0.0.0")) as (_, port):
        assert status_ok(await http_raw(port, http_request("GET", "/state.json")))  # loopback: no warning
        dial = (
            "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10); "
            "s.sendall(b'GET /state.json HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n'); "
            "print(s.recv(12).decode())"
        )
        for _ in range(2):  # twice: the warning is once per address
            process = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                "-c",
                dial,
                near_address,
                str(port),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(process.communicate(), 20)
            assert process.returncode == 0 and out.startswith(b"HTTP/1.1 200"), (out, err)
    warnings = [r.getMessage() for r in caplog.records if "event=cleartext_peer" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert far_address in warnings[0] and "127.0.0.1" not in warnings[0]
    assert "gloo/NCCL" in warnings[0]


def status_ok(response: bytes) -> bool:
    return response.startswith(b"HTTP/1.1 200")
