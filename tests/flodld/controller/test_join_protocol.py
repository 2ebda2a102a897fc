"""Issue 18: the join channel is served by one protocol object per connection (`JoinProtocol`).

No StreamReader, task or coroutine per dial in its handshake nor per linked host, and the same refusals as
the join channel had over a `GatedReader` (the stream path, `handle_join`, since removed): frame-level
failures get no reply and a counted refusal, the pre-authentication allowance and the global budget drop
the connection at the port, the address's gate slot and the budget's bytes come back whatever the ending.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from flodld.controller.join import JoinProtocol
from flodld.controller.run import Controller
from flodld.net.preauth import PREAUTH_CONNECTION_BYTES, PreAuthBudget
from flodld.wire.frames import (
    FRAME_MAGIC,
    HEADER,
    NONCE_BYTES,
    PREAUTH_MAX_PAYLOAD,
    PROTOCOL_VERSION,
    FrameConnection,
    Role,
)
from flodld.wire.join import RankExited, Reject
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import decode_message
from flodld.wire.salt import new_salt
from tests.flodld.controller.agents import eventually, hello, join, options, started

PEER = "127.0.0.1"


@asynccontextmanager
async def controller_on_loopback(**overrides: object) -> AsyncIterator[tuple[Controller, int]]:
    # limit_loopback: the gate counts loopback peers too, so the tests can see the slots come back
    controller, port = await started(options(capacity=4, limit_loopback=True, **overrides))
    try:
        yield controller, port
    finally:
        await controller.close()


async def _raw(port: int, first: bytes) -> socket.socket:
    """A plain socket (no StreamReader on this side either) that sends `first`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, first)
    return sock


async def _dial(port: int, key: bytes) -> tuple[socket.socket, FrameConnection]:
    """Magic and nonce sent, the listener's nonce read: the next bytes are the first frame."""
    conn = FrameConnection(Role.DIALER, key, channel=Channel.JOIN)
    sock = await _raw(port, magic_prefix(Channel.JOIN) + conn.initial_bytes())
    nonce, loop = b"", asyncio.get_running_loop()
    while len(nonce) < NONCE_BYTES:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, NONCE_BYTES - len(nonce)), 5)
        assert chunk, "closed before the listener's nonce"
        nonce += chunk
    conn.receive_data(nonce)
    return sock, conn


async def _reply(sock: socket.socket, conn: FrameConnection) -> object:
    """The first frame's message, or None when the controller closed without one."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
        except ConnectionError:
            return None
        conn.receive_data(data)
        event = conn.next_event()
        if hasattr(event, "payload"):
            return decode_message(event.kind, event.payload)  # type: ignore[union-attr]
        if not data:
            return None


def _refused(controller: Controller) -> dict[str, int]:
    assert controller.window is not None
    return dict(controller.window.ledger.refused_counts)


def _settled(controller: Controller) -> bool:
    return controller.mux.gate.pending(PEER) == 0 and controller.mux.budget.used == 0


def _count(kind: type) -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kind))


async def test_join_handshakes_in_flight_hold_no_stream_reader_task_or_coroutine() -> None:
    async with controller_on_loopback(max_pending_per_peer=64) as (controller, port):
        tasks, readers = len(asyncio.all_tasks()), _count(asyncio.StreamReader)
        socks = [await _raw(port, magic_prefix(Channel.JOIN) + bytes(NONCE_BYTES)) for _ in range(20)]
        mux = controller.mux
        await eventually(lambda: len(mux._served) == 20 and mux.gate.pending(PEER) == 20)
        assert len(asyncio.all_tasks()) == tasks and not controller.mux._tasks
        assert _count(asyncio.StreamReader) == readers
        assert _count(JoinProtocol) >= 20
        for sock in socks:
            sock.close()
        await eventually(lambda: not controller.mux._served and _settled(controller))
        assert _refused(controller) == {"eof_before_hello": 20}


async def test_a_linked_host_is_served_by_its_protocol_object_without_a_task() -> None:
    async with controller_on_loopback() as (controller, port):
        agent = await join(port, controller.salt, "a")
        assert agent.accepted.ranks == [0]
        link = controller.links["a"]
        assert isinstance(link.stream, JoinProtocol) and not controller.mux._tasks
        await eventually(lambda: _settled(controller))
        await agent.stream.aclose()
        await eventually(lambda: "a" not in controller.links and not controller.mux._served)


async def test_silence_after_the_nonce_is_refused_at_the_handshake_deadline_without_a_reply() -> None:
    async with controller_on_loopback(handshake_timeout=0.3) as (controller, port):
        sock, conn = await _dial(port, controller.salt)
        assert await _reply(sock, conn) is None
        await eventually(lambda: _refused(controller) == {"handshake_timeout": 1} and _settled(controller))
        sock.close()


async def test_a_wrong_key_and_a_replayed_first_frame_get_no_reply_and_a_counted_refusal() -> None:
    async with controller_on_loopback() as (controller, port):
        sock, conn = await _dial(port, new_salt())
        await asyncio.get_running_loop().sock_sendall(sock, conn.send_message(hello("forger")))
        assert await _reply(sock, conn) is None
        sock.close()
        sock, conn = await _dial(port, controller.salt)
        conn.send_message(hello("replayer"))  # seq 0, never sent: the frame that arrives is seq 1
        await asyncio.get_running_loop().sock_sendall(sock, conn.send_message(hello("replayer")))
        assert await _reply(sock, conn) is None
        sock.close()
        await eventually(lambda: _refused(controller) == {"bad_tag": 1, "replay": 1} and _settled(controller))
        assert not controller.links


@pytest.mark.parametrize(("payload", "tail"), [(PREAUTH_MAX_PAYLOAD + 1, 0), (10, 1), (16 * 1024 * 1024, 0)])
async def test_a_first_frame_over_the_small_caps_is_refused_from_its_header(payload: int, tail: int) -> None:
    async with controller_on_loopback() as (controller, port):
        sock, conn = await _dial(port, controller.salt)
        header = HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0x0101, 0, payload, tail)
        await asyncio.get_running_loop().sock_sendall(sock, header)
        assert await _reply(sock, conn) is None
        await eventually(lambda: _refused(controller) == {"too_large": 1} and _settled(controller))
        sock.close()


async def test_bytes_past_the_allowance_are_dropped_at_the_port_before_they_are_held() -> None:
    async with controller_on_loopback() as (controller, port):
        sock = await _raw(port, magic_prefix(Channel.JOIN) + b"\x00" * (PREAUTH_CONNECTION_BYTES * 4))
        await eventually(lambda: controller.counters.dropped["preauth_overrun"] == 1 and _settled(controller))
        assert _refused(controller) == {}  # the port counted it, not the window
        sock.close()


async def test_the_global_budget_bounds_every_join_handshake_together() -> None:
    async with controller_on_loopback(max_pending_per_peer=100) as (controller, port):
        limit = 3 * PREAUTH_CONNECTION_BYTES
        controller.mux.budget = PreAuthBudget(limit)
        dials = [await _dial(port, new_salt()) for _ in range(8)]
        loop = asyncio.get_running_loop()
        for sock, _ in dials:  # each within its own allowance, all together past the budget
            header = HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0x0101, 0, PREAUTH_MAX_PAYLOAD, 0)
            await loop.sock_sendall(sock, header + b"y" * (PREAUTH_MAX_PAYLOAD // 2))
        await eventually(lambda: controller.counters.dropped["preauth_budget"] >= 1)
        assert controller.mux.budget.used <= limit
        for sock, _ in dials:
            sock.close()
        await eventually(lambda: _settled(controller))
        agent = await join(port, controller.salt, "after")  # served once the budget is free again
        assert agent.accepted.ranks == [0]
        await agent.stream.aclose()


async def test_a_hello_that_does_not_decode_or_another_first_message_gets_a_reject() -> None:
    async with controller_on_loopback() as (controller, port):
        sock, conn = await _dial(port, controller.salt)
        await asyncio.get_running_loop().sock_sendall(sock, conn.send_frame(0x0101, b"\xff not a hello"))
        reply = await _reply(sock, conn)
        assert isinstance(reply, Reject) and reply.code == "bad_payload"
        sock.close()
        sock, conn = await _dial(port, controller.salt)
        await asyncio.get_running_loop().sock_sendall(sock, conn.send_message(RankExited(rank=0, code=0)))
        reply = await _reply(sock, conn)
        assert isinstance(reply, Reject) and reply.code == "expected_hello"
        sock.close()
        await eventually(
            lambda: _refused(controller) == {"bad_payload": 1, "expected_hello": 1} and _settled(controller)
        )


async def test_a_dialer_closing_mid_frame_is_refused_as_truncated() -> None:
    async with controller_on_loopback() as (controller, port):
        sock, conn = await _dial(port, controller.salt)
        frame = conn.send_message(hello("cut"))
        await asyncio.get_running_loop().sock_sendall(sock, bytes(frame[: len(frame) // 2]))
        sock.shutdown(socket.SHUT_WR)
        assert await _reply(sock, conn) is None
        await eventually(lambda: _refused(controller) == {"truncated": 1} and _settled(controller))
        sock.close()
