"""Blocking adapter: the same framed channel on a plain socket, for code called from torch's threads.

One lock per direction, so one thread may send while another waits in `recv`. The socket stays in
blocking mode: receive deadlines are waited for with poll() and send stalls are bounded by SO_SNDTIMEO,
so the two directions never share (and race on) Python's per-socket timeout.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from types import TracebackType
from typing import TypedDict, Unpack

from flodld.net.frames import next_frame
from flodld.net.stream import HANDSHAKE_SECS, READ_CHUNK, WRITE_STALL_SECS
from flodld.net.timeouts import scaled
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame, FrameConnection, NeedData, Role, Tail
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import Message


class FrameLimits(TypedDict, total=False):
    """The caps a channel's frames are held to; an absent one is FrameConnection's default
    (MAX_PAYLOAD, DEFAULT_MAX_TAIL).
    """

    max_payload: int
    max_tail: int


class BlockingChannel:
    """Authenticated frames over a connected blocking socket."""

    def __init__(self, sock: socket.socket, conn: FrameConnection) -> None:
        sock.settimeout(None)
        _set_send_timeout(sock, scaled(WRITE_STALL_SECS))
        self.sock = sock
        self.conn = conn
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._spare: bytearray | None = None  # where large frames are built, reused (sent before reuse)
        self._closed = False

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        channel: Channel,
        key: bytes,
        *,
        timeout: float,
        **limits: Unpack[FrameLimits],
    ) -> BlockingChannel:
        """Dial `channel`: write magic and nonce, wait up to `timeout` for the listener's nonce."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = FrameConnection(Role.DIALER, key, channel=channel, **limits)
            return cls._handshake(sock, conn, magic_prefix(channel), timeout)
        except BaseException:
            sock.close()
            raise

    @classmethod
    def accept(
        cls,
        sock: socket.socket,
        key: bytes,
        *,
        channel: Channel,
        timeout: float | None = None,
        **limits: Unpack[FrameLimits],
    ) -> BlockingChannel:
        """Listener side on an accepted socket whose channel magic (`channel`) was already read.

        The wait for the dialer's nonce is always bounded: `timeout`, or scaled 10 s when None.
        """
        conn = FrameConnection(Role.LISTENER, key, channel=channel, **limits)
        return cls._handshake(sock, conn, b"", timeout if timeout is not None else scaled(HANDSHAKE_SECS))

    @classmethod
    def _handshake(
        cls, sock: socket.socket, conn: FrameConnection, prefix: bytes, timeout: float
    ) -> BlockingChannel:
        """Send `prefix` (the dialer's channel magic) and this end's nonce, then wait for the peer's."""
        link = cls(sock, conn)
        link._sendall(prefix + conn.initial_bytes())
        deadline = _deadline(timeout)
        while not link.conn.ready:
            if not isinstance(link.conn.next_event(), NeedData):  # pragma: no cover
                raise WireError("handshake", "unexpected event before the nonce exchange completed")
            link._read_more(deadline, "the peer's nonce")
        return link

    def send(self, msg: Message, tail: Tail = b"") -> None:
        with self._send_lock:
            self._sendall(self.conn.send_message(msg, tail, buffer=self._spare))

    def send_frame(self, kind: int, payload: bytes, tail: Tail = b"") -> None:
        with self._send_lock:
            self._sendall(self.conn.send_frame(kind, payload, tail, buffer=self._spare))

    def _sendall(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except BlockingIOError:
            raise TimeoutError(f"send made no progress for {scaled(WRITE_STALL_SECS):.0f}s") from None
        # A large frame built in a fresh map: keep a buffer of its size (sendall is done with it, so the
        # next large frame can be built there, on pages that are already mapped).
        fresh_map = isinstance(data, memoryview) and not isinstance(data.obj, bytearray)
        if fresh_map and (self._spare is None or len(self._spare) < len(data)):
            self._spare = bytearray(len(data))

    def recv(self, timeout: float | None = None) -> Frame:
        """The next frame. EOFError on a clean close; WireError on a violation; TimeoutError on timeout.

        The timeout bounds the whole call; bytes already read stay buffered, so a later call resumes.
        """
        deadline = _deadline(timeout)
        with self._recv_lock:
            while (frame := next_frame(self.conn)) is None:
                self._read_more(deadline, "a frame")
            return frame

    def _read_more(self, deadline: float | None, what: str) -> None:
        want = min(max(self.conn.bytes_wanted, 1), READ_CHUNK)
        if deadline is not None:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if not poller.poll(remaining_ms):
                raise TimeoutError(f"timed out waiting for {what}")
        view = self.conn.receive_buffer()
        if view is not None and len(view):
            # The frame body: straight into the buffer it is decrypted in, no intermediate copy.
            try:
                count = self.sock.recv_into(view)
            except ConnectionResetError:
                count = 0
            finally:
                view.release()
            self.conn.receive_filled(count)
            return
        try:
            data = self.sock.recv(want)
        except ConnectionResetError:
            data = b""
        self.conn.receive_data(data)

    def rekey(self, salt: bytes) -> None:
        self.conn.rekey(salt)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()

    def __enter__(self) -> BlockingChannel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _set_send_timeout(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    micro = int((seconds - whole) * 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, micro))
