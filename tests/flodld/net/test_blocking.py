"""The blocking adapter over real loopback sockets, against an asyncio server and against itself."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from flodld.net import BlockingChannel, FramedStream
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.join import Abort, Accept, RankExited
from flodld.wire.magic import MAGIC_BYTES, Channel, channel_for_prefix
from tests.flodld.net.conftest import SALT, echo, framed_server

OTHER_SALT = bytes(range(16, 32))


async def test_blocking_client_talks_to_an_asyncio_server() -> None:
    def client(port: int) -> list[Frame]:
        with BlockingChannel.connect("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5) as link:
            link.send(Abort(reason="first"))  # a first frame is small (pre-authentication caps)
            link.send(RankExited(rank=2, code=1), tail=b"\x01" * 100_000)
            return [link.recv(timeout=5), link.recv(timeout=5)]

    async with framed_server(echo) as (port, problems):
        first, second = await asyncio.to_thread(client, port)
    assert (first.seq, first.message()) == (0, Abort(reason="first"))
    assert second.message() == RankExited(rank=2, code=1) and second.tail == b"\x01" * 100_000
    assert problems == []


async def test_blocking_client_with_the_wrong_salt_is_dropped() -> None:
    def client(port: int) -> None:
        with BlockingChannel.connect("127.0.0.1", port, Channel.RENDEZVOUS, OTHER_SALT, timeout=5) as link:
            link.send(Abort(reason="forged"))
            with pytest.raises(EOFError):
                link.recv(timeout=5)

    async with framed_server(echo) as (port, problems):
        await asyncio.to_thread(client, port)
    assert [getattr(problem, "code", problem) for problem in problems] == ["bad_tag"]


async def test_asyncio_server_answer_after_a_blocking_timeout_is_not_lost() -> None:
    release = threading.Event()

    async def slow(stream: FramedStream) -> None:
        await asyncio.to_thread(release.wait, 5)
        await stream.send(Abort(reason="late"))
        await stream.recv(timeout=5)

    def client(port: int) -> Frame:
        with BlockingChannel.connect("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5) as link:
            with pytest.raises(TimeoutError):
                link.recv(timeout=0.05)
            release.set()
            frame = link.recv(timeout=5)
            link.send(Abort(reason="bye"))
            return frame

    async with framed_server(slow) as (port, problems):
        frame = await asyncio.to_thread(client, port)
    assert frame.message() == Abort(reason="late")
    assert problems == []


@pytest.fixture
def listening_socket() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(5)
        yield server


def _accept(server: socket.socket, key: bytes = SALT) -> BlockingChannel:
    sock, _peer = server.accept()
    prefix = sock.recv(MAGIC_BYTES, socket.MSG_WAITALL)
    assert channel_for_prefix(prefix) is Channel.RENDEZVOUS
    return BlockingChannel.accept(sock, key, channel=Channel.RENDEZVOUS, timeout=5)


def _blocking_pair(server: socket.socket) -> tuple[BlockingChannel, BlockingChannel]:
    """(dialer, listener); the listener accepts in a thread because both handshakes block."""
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(_accept, server)
        dialer = BlockingChannel.connect(
            "127.0.0.1", server.getsockname()[1], Channel.RENDEZVOUS, SALT, timeout=5
        )
        return dialer, accepted.result(5)


def test_blocking_pair_sends_while_another_thread_waits_in_recv(listening_socket: socket.socket) -> None:
    received: list[Frame] = []
    dialer, listener = _blocking_pair(listening_socket)
    with dialer, listener:
        waiter = threading.Thread(target=lambda: received.append(dialer.recv(timeout=5)))
        waiter.start()
        time.sleep(0.05)  # let the waiter block in recv before this thread sends on the same socket
        dialer.send(RankExited(rank=0, code=0))
        assert listener.recv(timeout=5).message() == RankExited(rank=0, code=0)
        listener.send(Abort(reason="reply"))
        waiter.join(5)
    assert [frame.message() for frame in received] == [Abort(reason="reply")]


def test_blocking_recv_sees_clean_close_and_truncation(listening_socket: socket.socket) -> None:
    dialer, listener = _blocking_pair(listening_socket)
    with dialer:
        listener.close()
        with pytest.raises(EOFError):
            dialer.recv(timeout=5)
    dialer, listener = _blocking_pair(listening_socket)
    with dialer:
        wire = listener.conn.send_message(Abort(reason="cut short"))
        listener.sock.sendall(wire[:-3])
        listener.close()
        with pytest.raises(WireError) as caught:
            dialer.recv(timeout=5)
        assert caught.value.code == "truncated"


def test_blocking_connect_times_out_without_a_nonce(listening_socket: socket.socket) -> None:
    port = listening_socket.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="nonce"):
        BlockingChannel.connect("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=0.2)
    assert time.monotonic() - started < 3


async def test_blocking_client_rekeys_after_an_open_admission_accept() -> None:
    async def admit(stream: FramedStream) -> None:
        await stream.recv(timeout=5)
        await stream.send(Accept(ranks=[0], salt_hex=OTHER_SALT.hex(), formation_wait_secs=1.0, run_id="r"))
        stream.rekey(OTHER_SALT)
        await stream.send(Abort(reason="under the run salt"))
        await stream.recv(timeout=5)

    def client(port: int) -> Frame:
        with BlockingChannel.connect("127.0.0.1", port, Channel.RENDEZVOUS, bytes(16), timeout=5) as link:
            link.send(Abort(reason="hello stand-in"))
            accept = link.recv(timeout=5).message()
            assert isinstance(accept, Accept) and accept.salt_hex is not None
            link.rekey(bytes.fromhex(accept.salt_hex))
            frame = link.recv(timeout=5)
            link.send(RankExited(rank=0, code=0))
            return frame

    async with framed_server(admit, key=bytes(16)) as (port, problems):
        frame = await asyncio.to_thread(client, port)
    assert frame.message() == Abort(reason="under the run salt")
    assert problems == []
