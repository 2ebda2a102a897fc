"""The asyncio adapter over real loopback sockets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from flodld.net import (
    ConnectError,
    FramedStream,
    accept_channel,
    connect_with_retry,
    open_channel,
    read_channel_prefix,
)
from flodld.wire.errors import WireError
from flodld.wire.frames import FRAME_MAGIC, HEADER, PROTOCOL_VERSION
from flodld.wire.join import Abort, Accept, RankExited
from flodld.wire.magic import Channel, magic_prefix
from tests.flodld.net.conftest import SALT, echo, framed_server, loopback_server

OTHER_SALT = bytes(range(16, 32))


async def test_messages_and_tails_round_trip_through_an_echo_server() -> None:
    big_tail = bytes(range(256)) * 40_000  # ~10 MB: several read chunks
    async with (
        framed_server(echo) as (port, problems),
        await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5) as stream,
    ):
        await stream.send(Abort(reason="hello"))  # a first frame is small (pre-authentication caps)
        await stream.send(RankExited(rank=1, code=0), tail=big_tail)
        first = await stream.recv(timeout=5)
        second = await stream.recv(timeout=5)
    assert (first.seq, first.message()) == (0, Abort(reason="hello"))
    assert second.message() == RankExited(rank=1, code=0) and second.tail == big_tail
    assert problems == []


async def test_a_first_frame_over_the_pre_authentication_caps_is_refused_unread() -> None:
    async with (
        framed_server(echo) as (port, problems),
        await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5) as stream,
    ):
        await stream.send(
            RankExited(rank=1, code=0), tail=b"t" * 4096
        )  # fine after auth, not as a first frame
        with pytest.raises((EOFError, WireError, ConnectionError)):
            await stream.recv(timeout=5)
    assert [getattr(problem, "code", None) for problem in problems] == ["too_large"]


async def test_recv_timeout_loses_nothing() -> None:
    release = asyncio.Event()

    async def slow(stream: FramedStream) -> None:
        await release.wait()
        await stream.send(Abort(reason="late"))

    async with framed_server(slow) as (port, _problems):
        stream = await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5)
        with pytest.raises(TimeoutError):
            await stream.recv(timeout=0.05)
        release.set()
        assert (await stream.recv(timeout=5)).message() == Abort(reason="late")
        await stream.aclose()


async def test_clean_close_is_eof_error() -> None:
    async def hang_up(stream: FramedStream) -> None:
        await stream.aclose()

    async with framed_server(hang_up) as (port, _problems):
        stream = await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, SALT, timeout=5)
        with pytest.raises(EOFError):
            await stream.recv(timeout=5)
        await stream.aclose()


async def test_wrong_salt_fails_authentication_at_the_server() -> None:
    async with framed_server(echo) as (port, problems):
        stream = await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, OTHER_SALT, timeout=5)
        await stream.send(Abort(reason="forged"))
        with pytest.raises(EOFError):  # the server drops the link without answering
            await stream.recv(timeout=5)
        await stream.aclose()
    assert [getattr(problem, "code", problem) for problem in problems] == ["bad_tag"]


async def test_server_refuses_an_over_cap_header_without_reading_the_body() -> None:
    async with framed_server(echo, max_payload=1024) as (port, problems):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.RENDEZVOUS) + bytes(16))
        await reader.readexactly(16)
        # Claim a 1 MiB payload and send none of it: the server must refuse from the header alone.
        writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0x0106, 0, 1 << 20, 0))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    assert [getattr(problem, "code", problem) for problem in problems] == ["too_large"]


async def test_rekey_mid_stream_like_open_admission() -> None:
    run_salt = OTHER_SALT

    async def admit(stream: FramedStream) -> None:
        await stream.recv(timeout=5)
        await stream.send(Accept(ranks=[0], salt_hex=run_salt.hex(), formation_wait_secs=1.0, run_id="r"))
        stream.rekey(run_salt)
        await stream.send(Abort(reason="under the run salt"))
        assert (await stream.recv(timeout=5)).message() == RankExited(rank=0, code=0)

    async with framed_server(admit, key=bytes(16)) as (port, problems):
        stream = await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, bytes(16), timeout=5)
        await stream.send(Abort(reason="hello stand-in"))
        accept = (await stream.recv(timeout=5)).message()
        assert isinstance(accept, Accept) and accept.salt_hex is not None
        stream.rekey(bytes.fromhex(accept.salt_hex))
        assert (await stream.recv(timeout=5)).message() == Abort(reason="under the run salt")
        await stream.send(RankExited(rank=0, code=0))
        with pytest.raises(EOFError):
            await stream.recv(timeout=5)
        await stream.aclose()
    assert problems == []


async def test_garbage_from_the_listener_is_a_wire_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4 + 16)
        writer.write(bytes(16) + b"x" * 24)  # a nonce, then a header with no frame magic
        await writer.drain()

    async with loopback_server(garbage) as port:
        stream = await open_channel("127.0.0.1", port, Channel.DATA, SALT, timeout=5)
        with pytest.raises(WireError) as caught:
            await stream.recv(timeout=5)
        assert caught.value.code == "bad_magic"
        await stream.aclose()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_connect_with_retry_names_what_where_and_attempts() -> None:
    port = _free_port()
    with pytest.raises(ConnectError) as caught:
        await connect_with_retry(
            "127.0.0.1", port, Channel.JOIN, SALT, what="agent join", attempts=3, backoff=0.01
        )
    text = str(caught.value)
    assert text.startswith(f"agent join: connect to 127.0.0.1:{port} (join channel) failed after 3 attempts")
    assert "ConnectionRefused" in text


async def test_connect_with_retry_says_once_that_it_keeps_trying_after_the_first_failure() -> None:
    port = _free_port()
    heard: list[tuple[str, float]] = []
    with pytest.raises(ConnectError):
        await connect_with_retry(
            "127.0.0.1", port, Channel.JOIN, SALT, what="agent join", attempts=4, backoff=0.01,
            on_first_failure=lambda error, left: heard.append((type(error).__name__, left)),
        )  # fmt: skip
    assert [name for name, _ in heard] == ["ConnectionRefusedError"] and heard[0][1] == pytest.approx(0.03)


async def test_connect_with_retry_reaches_a_server_that_starts_late() -> None:
    port = _free_port()

    async def start_later() -> asyncio.Server:
        await asyncio.sleep(0.2)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(4)
            stream = await accept_channel(reader, writer, SALT, channel=Channel.CONTROL, timeout=5)
            await stream.send(Abort(reason="hi"))

        return await asyncio.start_server(serve, "127.0.0.1", port)

    starter = asyncio.create_task(start_later())
    stream = await connect_with_retry(
        "127.0.0.1", port, Channel.CONTROL, SALT, what="relay control", attempts=50, backoff=0.05
    )
    assert (await stream.recv(timeout=5)).message() == Abort(reason="hi")
    await stream.aclose()
    server = await starter
    server.close()
    await server.wait_closed()


async def test_open_channel_times_out_when_the_listener_never_answers() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with loopback_server(silent) as port:
        with pytest.raises(TimeoutError):
            await open_channel("127.0.0.1", port, Channel.JOIN, SALT, timeout=0.2)


async def test_accept_channel_bounds_the_wait_for_a_silent_dialer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.1")  # default handshake bound: 10 s * 0.1
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(4)
            await accept_channel(reader, writer, SALT, channel=Channel.JOIN)
            outcome.set_result(None)
        except BaseException as error:
            outcome.set_result(error)
        finally:
            writer.close()

    async with loopback_server(serve) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(magic_prefix(Channel.JOIN))  # the magic, then silence instead of a nonce
        started = asyncio.get_running_loop().time()
        assert isinstance(await asyncio.wait_for(outcome, 5), TimeoutError)
        assert 0.5 < asyncio.get_running_loop().time() - started < 3
        writer.close()


@pytest.mark.parametrize(
    ("sent", "expected"),
    [(magic_prefix(Channel.DATA), Channel.DATA), (b"GET / HTTP/1.1\r\n", Channel.HTTP), (b"SSH-2.0", None)],
)
async def test_read_channel_prefix_names_the_channel(sent: bytes, expected: Channel | None) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(sent)
    assert await read_channel_prefix(reader, timeout=1) == (expected, sent[:4])
