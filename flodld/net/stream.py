"""asyncio adapter: a FrameConnection driven by a StreamReader/StreamWriter pair.

Inside a frame the stream reads exactly what the connection asks for (`bytes_wanted`), so it never
reads a body past what its header announced, and an over-cap header is refused before its body is read.
At a frame boundary it takes what the StreamReader already holds, up to `READ_AHEAD` bytes (bytes that
arrived and were counted already): small frames sent back to back cost one read, not two per frame.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Callable
from types import TracebackType

from flodld.net.keepalive import tcp_socket
from flodld.net.preauth import GatedReader
from flodld.net.timeouts import scaled
from flodld.wire.errors import WireError
from flodld.wire.frames import (
    DEFAULT_MAX_TAIL,
    MAX_PAYLOAD,
    Closed,
    Frame,
    FrameConnection,
    NeedData,
    Role,
    Tail,
)
from flodld.wire.magic import MAGIC_BYTES, Channel, channel_for_prefix, magic_prefix
from flodld.wire.messages import Message

READ_CHUNK = 4 * 1024 * 1024
# At a frame boundary: read up to this much of what has arrived (the StreamReader's own limit).
READ_AHEAD = 64 * 1024
WRITE_PIECE = 1024 * 1024
WRITE_STALL_SECS = 30.0
CONNECT_ATTEMPTS = 60
CONNECT_BACKOFF_SECS = 0.5
HANDSHAKE_SECS = 10.0


class ConnectError(ConnectionError):
    """Every connection attempt failed; the message names what, where, how often and the last error."""


class _DirectReceiver(asyncio.BufferedProtocol):
    """Reads a transport straight into its FrameConnection's buffers (no StreamReader in between).

    Installed by `FramedStream.read_directly`: the kernel copies a frame's body into the buffer the frame
    is decrypted in, instead of into a bytes object, the StreamReader's buffer, a slice of it and then the
    connection's buffer. Reading stays driven by `recv`: a request reads one frame, its header and then
    its body (the header parsed as soon as it is in: `FrameConnection.start_body`), as many reads as the
    bytes come in, the reader woken once, when the frame is complete, never past it (`bytes_wanted`), the
    transport paused in between (back-pressure as before). One pause, resume and wake-up per frame, not
    one for its header and another for its body.
    Writing is untouched: flow control and the close waiter stay with the transport's previous protocol.
    """

    def __init__(
        self, conn: FrameConnection, transport: asyncio.Transport, previous: asyncio.BaseProtocol
    ) -> None:
        self._conn = conn
        self._transport = transport
        self._previous = previous
        self._scratch = bytearray(64 * 1024)
        self._direct = False
        self._waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.eof = False

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._conn.receive_buffer()
        if view is not None and len(view):
            self._direct = True
            return view
        self._direct = False
        return memoryview(self._scratch)[: min(max(self._conn.bytes_wanted, 1), len(self._scratch))]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct:
                self._conn.receive_filled(nbytes)
            else:
                self._conn.receive_data(bytes(self._scratch[:nbytes]))
                self._conn.start_body()  # a header that came whole: its body is read straight in next
            if self._conn.bytes_wanted:
                # The frame being read is not complete: keep reading into it, with no wake-up of the reader
                # per read (the next `get_buffer` is the rest of its header or body, nothing past it).
                return
        except BaseException as error:  # a WireError: recv raises it from next_event
            self.error = error
        self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True  # half-close: our side may still write

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()
        self._previous.connection_lost(exc)

    def pause_writing(self) -> None:
        self._previous.pause_writing()

    def resume_writing(self) -> None:
        self._previous.resume_writing()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read_more(self) -> None:
        """One read into the connection (or its end) ; raises what ended the connection."""
        if self.error is not None:
            raise self.error
        if self.eof:
            self._conn.receive_data(b"")
            return
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.resume_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None
            if not self._transport.is_closing():
                self._transport.pause_reading()
        if self.error is not None:
            raise self.error
        if self.eof:
            self._conn.receive_data(b"")


class FramedStream:
    """Encrypted, authenticated frames over an asyncio stream pair (see flodld.wire.frames for the rules)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: FrameConnection
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn
        self._recv_lock = asyncio.Lock()
        self._send_lock = asyncio.Lock()
        self._mid_frame = False  # a large frame is being written piece by piece
        self._deferred: list[bytearray | memoryview] = []  # send_nowait frames sealed meanwhile
        # Where large frames are built, reused while their pages are warm: two, so the next frame is built
        # while the transport may still hold the end of the last one. Each with the count of bytes
        # written up to its frame's end: free once the transport has sent that far (`_reusable`).
        self._spares: list[tuple[bytearray, int]] = []
        self._written = 0  # bytes this stream handed to the transport
        self._direct: _DirectReceiver | None = None

    @property
    def peername(self) -> tuple[str, int] | None:
        peer = self.writer.get_extra_info("peername")
        return (str(peer[0]), int(peer[1])) if peer else None

    async def send(self, msg: Message, tail: Tail = b"") -> None:
        """Write one message frame and wait (bounded by the write-stall timeout) until it is flushed."""
        async with self._send_lock:  # sealed under the lock: frames go out in sequence order
            await self._write(self.conn.send_message(msg, tail, buffer=self._reusable()))

    def send_nowait(self, msg: Message, tail: Tail = b"") -> None:
        """Queue one message frame without waiting for the socket (for callbacks that cannot await)."""
        data = self.conn.send_message(msg, tail)
        if self._mid_frame:
            self._deferred.append(data)  # goes out right after the large frame being written
        else:
            self._put(data)

    def takes_at_once(self, nbytes: int) -> bool:
        """Whether `send_frame` of a frame of `nbytes` wire bytes returns without waiting: nothing is being
        sent or queued on this stream, and the frame stays within the transport's high-water mark.
        """
        transport = self.writer.transport
        free = not self._send_lock.locked() and not self._mid_frame and not transport.get_write_buffer_size()
        return free and nbytes <= transport.get_write_buffer_limits()[1]

    async def send_frame(self, kind: int, payload: bytes, tail: Tail = b"") -> None:
        async with self._send_lock:
            await self._write(self.conn.send_frame(kind, payload, tail, buffer=self._reusable()))

    def _put(self, data: bytearray | memoryview) -> None:
        self.writer.write(data)
        self._written += len(data)

    def _reusable(self) -> bytearray | None:
        """A spare buffer nothing queued still reads: the transport has sent every byte up to the end of the
        frame last built in it (a transport may hold views of what it has not sent yet). Bytes written
        around this stream only make the check more cautious.
        """
        if not self._spares:
            return None
        sent = self._sent()
        for buffer, end in self._spares:
            if end <= sent:
                return buffer
        return None

    async def _write(self, data: bytearray | memoryview) -> None:
        """Write a sealed frame and drain. A large frame goes in WRITE_PIECE pieces, each drained before the
        next, so the transport never buffers (copies) more than one piece of it.
        """
        if len(data) <= WRITE_PIECE:
            self._put(data)
            self._mark_spare(data)
        else:
            self._keep_spare(data)
            self._mid_frame = True
            try:
                with memoryview(data) as view:
                    for start in range(0, len(view), WRITE_PIECE):
                        self._put(view[start : start + WRITE_PIECE])
                        if start + WRITE_PIECE < len(view):
                            await self.drain()
            finally:
                self._mark_spare(data)
                self._mid_frame = False
                deferred, self._deferred = self._deferred, []
                for frame in deferred:
                    self._put(frame)
        await self.drain()

    def _sent(self) -> int:
        """Bytes of this stream's the transport has sent (handed over, less what it still buffers)."""
        return self._written - self.writer.transport.get_write_buffer_size()

    def _keep_spare(self, data: bytearray | memoryview) -> None:
        """A large frame built in a fresh map: keep a buffer of its size for a later frame instead (in a
        second slot, or in place of a free spare too small for it).
        """
        if not isinstance(data, memoryview) or isinstance(data.obj, bytearray):
            return  # built in a spare already
        if len(self._spares) < 2:
            self._spares.append((bytearray(len(data)), 0))
            return
        sent = self._sent()
        for index, (buffer, end) in enumerate(self._spares):
            if end <= sent and len(buffer) < len(data):
                self._spares[index] = (bytearray(len(data)), 0)
                return

    def _mark_spare(self, data: bytearray | memoryview) -> None:
        """The spare `data` was built in (if any) is in use up to the bytes written so far."""
        if isinstance(data, memoryview) and isinstance(data.obj, bytearray):
            for index, (buffer, _) in enumerate(self._spares):
                if buffer is data.obj:
                    self._spares[index] = (buffer, self._written)
                    return

    async def drain(self) -> None:
        transport = self.writer.transport
        if not transport.get_write_buffer_size() and not transport.is_closing():
            # Nothing queued, so writing is not paused: drain returns at once (or raises what ended the
            # connection). No write-stall deadline to arm and cancel for every small frame.
            await self.writer.drain()
            return
        async with asyncio.timeout(scaled(WRITE_STALL_SECS)):
            await self.writer.drain()

    async def recv(self, timeout: float | None = None) -> Frame:
        """The next frame.

        EOFError on a clean close; ConnectionResetError on a reset; WireError on a violation; TimeoutError
        past `timeout`. A timeout loses nothing: bytes already read stay buffered in the connection.
        """
        if not self._recv_lock.locked():
            # A frame already complete in the connection's buffer needs no lock and no read: nothing
            # between here and the return yields to another reader.
            event = self.conn.next_event()
            if isinstance(event, Frame):
                return event
            if isinstance(event, Closed):
                raise EOFError("peer closed the connection")
        async with self._recv_lock:
            if timeout is None:
                return await self._recv_loop()
            async with asyncio.timeout(timeout):
                return await self._recv_loop()

    async def _recv_loop(self) -> Frame:
        while True:
            event = self.conn.next_event()
            if isinstance(event, Frame):
                return event
            if isinstance(event, Closed):
                raise EOFError("peer closed the connection")
            await self._read_more()

    def read_directly(self) -> bool:
        """From now on, read the socket straight into the connection's buffers (see `_DirectReceiver`).

        For the data plane's bulk channels, after the handshake. Bytes the StreamReader already holds
        are handed to the connection first. False (and nothing changes) where the transport cannot
        switch protocols.
        """
        if self._direct is not None:
            return True
        transport = self.writer.transport
        buffered = getattr(self.reader, "_buffer", None)
        if not isinstance(transport, asyncio.Transport) or not isinstance(buffered, bytearray):
            return False
        if not hasattr(transport, "set_protocol") or transport.is_closing():
            return False
        if self.reader.at_eof() or self.reader.exception() is not None:
            return False
        direct = _DirectReceiver(self.conn, transport, transport.get_protocol())
        if buffered:
            self.conn.receive_data(bytes(buffered))
            buffered.clear()
        transport.pause_reading()
        transport.set_protocol(direct)
        self._direct = direct
        return True

    async def _read_more(self) -> None:
        if self._direct is not None:
            await self._direct.read_more()
            return
        # Inside a body: whatever has arrived, up to what completes it (never past the frame), and the
        # reader's own buffer stays small (a large body is gathered in the connection's buffer, not in
        # the StreamReader's, which would regrow and copy it). At a frame boundary: what has arrived, up
        # to READ_AHEAD, so a header and the small body behind it come in one read.
        wanted = self.conn.bytes_wanted
        want = READ_AHEAD if self.conn.at_boundary else min(max(wanted, 1), READ_CHUNK)
        data = await self.reader.read(want)
        # b"" is the end of the stream. A reset is not a clean close: ConnectionResetError propagates,
        # so callers can tell a peer that broke (e.g. a killed agent with unread data) from one that
        # finished (EOFError).
        self.conn.receive_data(data)

    async def complete_handshake(self, timeout: float | None) -> None:
        """Read until the peer's nonce has arrived."""
        async with asyncio.timeout(timeout):
            while not self.conn.ready:
                event = self.conn.next_event()
                if not isinstance(event, NeedData):  # pragma: no cover - frames cannot precede the nonce
                    raise WireError("handshake", "unexpected event before the nonce exchange completed")
                await self._read_more()

    def rekey(self, salt: bytes) -> None:
        self.conn.rekey(salt)

    def close(self) -> None:
        self.writer.close()

    async def aclose(self) -> None:
        """Close and wait until the transport is gone."""
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = tcp_socket(writer)
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def open_channel(
    host: str,
    port: int,
    channel: Channel,
    key: bytes,
    *,
    timeout: float,
    max_payload: int = MAX_PAYLOAD,
    max_tail: int = DEFAULT_MAX_TAIL,
) -> FramedStream:
    """Dial `channel` on host:port: write magic and nonce, then wait for the listener's nonce (`timeout`)."""
    conn = FrameConnection(Role.DIALER, key, max_payload=max_payload, max_tail=max_tail, channel=channel)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        stream = FramedStream(reader, writer, conn)
        try:
            _nodelay(writer)
            writer.write(magic_prefix(channel) + conn.initial_bytes())
            await writer.drain()
            await stream.complete_handshake(None)
        except BaseException:
            writer.close()
            raise
    return stream


async def accept_channel(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: bytes,
    *,
    channel: Channel | None = None,
    timeout: float | None = None,
    max_payload: int = MAX_PAYLOAD,
    max_tail: int = DEFAULT_MAX_TAIL,
) -> FramedStream:
    """Listener side, after the mux consumed the magic: send our nonce, read the dialer's.

    The session key is bound to `channel`; when None, the channel the mux routed `reader` to (a
    `GatedReader`) — a plain reader needs the channel named. With a `GatedReader`, the first verified
    frame ends its pre-authentication accounting. The wait for the dialer's nonce is always bounded:
    `timeout`, or scaled 10 s when None.
    """
    gated = reader if isinstance(reader, GatedReader) else None
    if channel is None:
        if gated is None:
            raise ValueError(
                "accept_channel needs the channel (the magic it was reached by) to bind the session key"
            )
        channel = gated.channel
    conn = FrameConnection(
        Role.LISTENER,
        key,
        max_payload=max_payload,
        max_tail=max_tail,
        channel=channel,
        on_authenticated=gated.authenticated if gated is not None else None,
    )
    _nodelay(writer)
    writer.write(conn.initial_bytes())
    stream = FramedStream(reader, writer, conn)
    await stream.complete_handshake(timeout if timeout is not None else scaled(HANDSHAKE_SECS))
    return stream


async def connect_with_retry(
    host: str,
    port: int,
    channel: Channel,
    key: bytes,
    *,
    what: str,
    attempts: int | None = None,
    backoff: float = CONNECT_BACKOFF_SECS,
    timeout: float | None = None,
    max_payload: int = MAX_PAYLOAD,
    max_tail: int = DEFAULT_MAX_TAIL,
    on_first_failure: Callable[[BaseException, float], None] | None = None,
) -> FramedStream:
    """`open_channel` retried on refused/reset/timed-out dials and unfinished handshakes.

    Defaults: ceil(60 * scale) attempts, 0.5 s apart; each attempt bounded by `timeout` (scaled 10 s).
    `on_first_failure(error, seconds_left)` hears of the first failed attempt when more are to come, so a
    caller can say what it is waiting for instead of retrying in silence.
    """
    total = attempts if attempts is not None else max(1, math.ceil(CONNECT_ATTEMPTS * scaled(1.0)))
    if total < 1:
        raise ValueError(f"attempts must be >= 1, got {total}")
    per_attempt = timeout if timeout is not None else scaled(HANDSHAKE_SECS)
    last: BaseException | None = None
    for attempt in range(total):
        if attempt:
            await asyncio.sleep(backoff)
        try:
            return await open_channel(
                host, port, channel, key, timeout=per_attempt, max_payload=max_payload, max_tail=max_tail
            )
        except (OSError, TimeoutError) as error:
            last = error
        except WireError as error:
            if error.code != "handshake":
                raise
            last = error
        if attempt == 0 and total > 1 and on_first_failure is not None and last is not None:
            on_first_failure(last, (total - 1) * backoff)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise ConnectError(
        f"{what}: connect to {where} ({channel} channel) failed after {total} attempts "
        f"(~{total * backoff:.1f}s): {last!r}"
    )


async def read_channel_prefix(
    reader: asyncio.StreamReader, *, timeout: float
) -> tuple[Channel | None, bytes]:
    """For a mux: read the 4-byte prefix and name its channel (None = unknown magic).

    The prefix is consumed; an HTTP handler must put it back in front of the request it parses.
    Raises asyncio.IncompleteReadError if the peer closes first, TimeoutError if it stays silent.
    """
    async with asyncio.timeout(timeout):
        prefix = await reader.readexactly(MAGIC_BYTES)
    return channel_for_prefix(prefix), prefix
