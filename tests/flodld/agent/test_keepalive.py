"""TCP keepalive on the links toward the controller: set on a real join link, scaled, bounded."""

from __future__ import annotations

import asyncio
import socket

import pytest

from flodld.agent.join import build_hello, join_world
from flodld.net.keepalive import KEEPALIVE_PROBES, dead_link_bound_secs, keep_alive

from .test_join_world import controller, spec


def _options(sock: socket.socket) -> tuple[int, int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


async def test_the_agent_join_link_carries_keepalive_scaled_by_the_timeout_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.2")  # 15 s idle -> 3 s
    ctl = controller(None)
    _, port = await ctl.start()
    try:
        agent = spec(port, None)
        joined = await join_world(agent, build_hello(agent, ["cpu:0"]))
        assert _options(joined.stream.writer.get_extra_info("socket")) == (1, 3, 1, KEEPALIVE_PROBES, 6000)
        await joined.stream.aclose()
    finally:
        await ctl.stop("test over")


async def test_keep_alive_skips_non_tcp_sockets_and_states_its_bound() -> None:
    left, right = socket.socketpair()
    _, writer = await asyncio.open_unix_connection(sock=left)
    try:
        assert keep_alive(writer, 9) is False
    finally:
        writer.close()
        right.close()
    assert dead_link_bound_secs(9) == 18
