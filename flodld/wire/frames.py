"""Frame codec and per-connection state, in the h11 style: bytes in, events out, no I/O.

Theory of operation (wire protocol version 2: every frame is encrypted and authenticated):
- The dialer writes the channel magic (its caller does) and a 16-byte nonce; the listener answers with
  its own nonce. Each side writes its nonce at once, without waiting for the other's. The low bit of a
  nonce's first byte is that side's cipher flag (1: its CPU has AES instructions); the other 127 bits
  are random. Both sides pick the same AEAD from the two flags: AES-256-GCM when both set theirs,
  ChaCha20-Poly1305 otherwise (`choose_suite`).
- Both sides then derive one 32-byte key per direction from the run salt (or, after `rekey`, a host key
  or an open admission's run salt), the two nonces, the channel's magic, the suite and the direction
  (`flodld.wire.aead`, the cipher and key schedule this module runs on).
- Each frame is a 24-byte cleartext header, the ciphertext of payload ‖ tail, and the 16-byte AEAD tag.
  The AEAD nonce is the direction byte, three zero bytes and the frame's 64-bit sequence number; the
  header is the associated data. So no header bit can be altered, a frame cannot be reflected back to
  its sender (other key, other nonce), and no (key, nonce) pair is ever used twice: a sequence number
  never repeats in one direction, and sending stops before it would wrap (`MAX_SEQ`, and for
  AES-GCM the lower `AES_GCM_MAX_FRAMES`).
- Sequence numbers start at 0 in each direction and must increase by exactly one: a replayed,
  reordered or dropped frame is refused (`replay`).
- Caps are checked from the header, before the body is buffered: a peer cannot make us allocate more
  than the caps allow, whatever length it claims, and a body's buffer grows with the bytes that
  arrive (`receive_buffer` / `receive_filled` let a shell read straight into it, at most
  `RECEIVE_WINDOW` ahead). The body is decrypted in place.
- The first frame a side receives is held to small pre-authentication caps (`PREAUTH_MAX_PAYLOAD`,
  no tail) until it verifies: a peer that has not proven the key cannot make us buffer more than that.
  After the first frame verifies, the connection's normal caps apply.
- A peer speaking another protocol version is refused from its first header (`bad_version`, naming
  both versions): version 1 frames (HMAC-authenticated cleartext) never reach the decryptor.
- Any violation kills the connection: the error is raised once, and every later call raises
  `WireError("closed")`.
"""

from __future__ import annotations

import mmap
import typing
from typing import Final

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from flodld.wire.aead import (
    DIRECTION,
    FRAME_NONCE,
    NONCE_BYTES,
    PEER,
    STREAM_SEAL_MIN,
    TAG_BYTES,
    Role,
    Suite,
    aead_for,
    check_key,
    choose_suite,
    direction_keys,
    new_nonce,
    open_in_place,
    open_into,
    seal_in_place,
    seal_parts,
)
from flodld.wire.errors import WireError, WireErrorCode
from flodld.wire.events import CLOSED, NEED_DATA, BytesLike, Closed, Frame, NeedData, Tail
from flodld.wire.header import (
    DEFAULT_MAX_TAIL,
    FRAME_MAGIC,
    HEADER,
    HEADER_BYTES,
    MAX_PAYLOAD,
    PREAUTH_MAX_PAYLOAD,
    PREAUTH_MAX_TAIL,
    PROTOCOL_VERSION,
    FrameHeader,
    parse_header,
)
from flodld.wire.magic import Channel
from flodld.wire.messages import Message, encode_message

# Importable from here as before the cipher, the header and the events had modules of their own.
__all__ = [
    "CLOSED", "DEFAULT_MAX_TAIL", "FRAME_MAGIC", "HEADER", "HEADER_BYTES", "MAX_PAYLOAD", "NEED_DATA",
    "NONCE_BYTES", "PREAUTH_MAX_PAYLOAD", "PREAUTH_MAX_TAIL", "PROTOCOL_VERSION", "TAG_BYTES", "BytesLike",
    "Closed", "Frame", "NeedData", "Role", "Suite", "Tail",
]  # fmt: skip

MAX_SEQ: Final = 2**64 - 1
# AES-GCM with a counter nonce is safe far beyond this; the bound keeps a single key's use well inside
# the usual 2^48-message guidance. ChaCha20-Poly1305 runs to the end of the 64-bit counter.
AES_GCM_MAX_FRAMES: Final = 2**48
# `cryptography` encrypts at most 2^31 - 1 bytes per call: payload + tail must fit in one call.
MAX_PLAINTEXT: Final = 2**31 - 1

_U32_MAX: Final = 2**32 - 1

# How far ahead of the bytes that arrived a frame body's buffer may grow for `receive_buffer`.
RECEIVE_WINDOW: Final = 4 * 1024 * 1024
_FIRST_BODY_BUFFER: Final = 1024 * 1024
# Frames from this size up are built and received in anonymous memory maps: the kernel hands out
# zeroed pages only as they are first written (no separate zero-fill pass over a fresh buffer, and a
# header that claims a large body commits only the pages of the bytes that actually arrive).
LARGE_FRAME: Final = 1024 * 1024
# How many large-frame buffers given back (`FrameConnection.recycle`) a connection keeps for its next
# frames.
RECYCLE_KEEP: Final = 2


def _large_buffer(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, size))


class FrameConnection:
    """One side of one framed connection; see the module docstring for the rules it enforces."""

    def __init__(
        self,
        role: Role,
        key: bytes,
        *,
        max_payload: int = MAX_PAYLOAD,
        max_tail: int = DEFAULT_MAX_TAIL,
        nonce: bytes | None = None,
        channel: Channel | None = None,
        preauth_max_payload: int = PREAUTH_MAX_PAYLOAD,
        preauth_max_tail: int = PREAUTH_MAX_TAIL,
        on_authenticated: typing.Callable[[], None] | None = None,
        aes: bool | None = None,
    ) -> None:
        """`aes` overrides this side's cipher flag (default: whether the CPU has AES instructions)."""
        if nonce is not None and len(nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        if not 0 <= max_payload <= _U32_MAX or not 0 <= max_tail <= _U32_MAX:
            raise ValueError(
                f"caps must be in 0..{_U32_MAX} bytes, got payload {max_payload}, tail {max_tail}"
            )
        self.role = role
        self._send_direction = DIRECTION[role]
        self._recv_direction = DIRECTION[PEER[role]]
        self.channel = channel
        self.max_payload = min(max_payload, MAX_PLAINTEXT)
        # One AEAD call seals payload and tail together: their sum stays within what the cipher takes.
        self.max_tail = min(max_tail, MAX_PLAINTEXT - self.max_payload)
        # Caps of the first received frame: the smaller of the pre-authentication and normal caps.
        self.preauth_max_payload = min(preauth_max_payload, self.max_payload)
        self.preauth_max_tail = min(preauth_max_tail, self.max_tail)
        self.on_authenticated = on_authenticated
        self._salt = check_key(key)
        self._nonce = nonce if nonce is not None else new_nonce(aes=aes)
        self._peer_nonce: bytes | None = None
        self.suite: Suite | None = None
        self._send_aead: AESGCM | ChaCha20Poly1305 | None = None
        self._send_key: bytes | None = None  # the AES-256-GCM send key, for `seal_parts`
        self._recv_aead: AESGCM | ChaCha20Poly1305 | None = None
        self._send_limit = MAX_SEQ + 1
        self._send_seq = 0
        self._recv_seq = 0
        self._buffer = bytearray()  # the nonce, a header, or bytes fed past the unit being read
        self._header: FrameHeader | None = None
        self._body: bytearray | memoryview | None = None  # ciphertext and tag of the frame being read
        self._body_total = 0  # the body's length, from its header
        self._sealed: memoryview | None = None  # the whole body when it came as one bytes object
        self._recycled: list[mmap.mmap] = []  # large frames' buffers given back (`recycle`), at most
        # RECYCLE_KEEP: a frame that waits (a chunk parked for a member before it) holds one while the
        # next frame is read into another
        self._filled = 0
        self._eof = False
        self._dead = False

    # --- state -----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Both nonces are known, so frames can be sent and verified."""
        return self._send_aead is not None

    @property
    def nonce(self) -> bytes:
        return self._nonce

    @property
    def peer_nonce(self) -> bytes | None:
        """The peer's nonce once it has arrived (None before)."""
        return self._peer_nonce

    @property
    def authenticated(self) -> bool:
        """At least one frame from the peer has verified: the peer holds this connection's key."""
        return self._recv_seq > 0

    @property
    def bytes_wanted(self) -> int:
        """How many more bytes complete the unit being read (nonce, header or body); 0 if complete.

        Shells read exactly this much, so they never read past the frame the header announced.
        """
        if self._peer_nonce is None:
            return max(0, NONCE_BYTES - len(self._buffer))
        if self._header is None:
            return max(0, HEADER_BYTES - len(self._buffer))
        return self._body_total - self._filled

    @property
    def at_boundary(self) -> bool:
        """Between frames: the nonce is in and no header is being read (later bytes may be buffered)."""
        return self._peer_nonce is not None and self._header is None

    def initial_bytes(self) -> bytes:
        """This side's nonce: the first thing it writes (the dialer writes the channel magic before it)."""
        return self._nonce

    # --- receiving -------------------------------------------------------------------------------

    def receive_data(self, data: BytesLike) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        self._ensure_alive()
        if self._eof:
            if data:
                self._fail("closed", "bytes arrived after end of stream")
            return
        if not data:
            self._eof = True
            return
        if self._body is not None and self._filled < self._body_total:
            view = memoryview(data).cast("B")
            take = min(len(view), self._body_total - self._filled)
            if self._filled == 0 and take == self._body_total and isinstance(data, bytes):
                # The whole body in one immutable piece (a shell read it at once): keep it without a
                # copy; it is decrypted from there into a buffer of its own.
                self._sealed = view[:take]
                self._filled = take
                if take == len(view):
                    return
                data = view[take:]
                take = 0
                view = memoryview(data).cast("B")
            if take:
                self._reserve(take)
                self._body[self._filled : self._filled + take] = view[:take]
            self._filled += take
            if take == len(view):
                return
            data = view[take:]
        if data:
            self._buffer += data
        if self._peer_nonce is None and len(self._buffer) >= NONCE_BYTES:
            self._peer_nonce = bytes(self._buffer[:NONCE_BYTES])
            del self._buffer[:NONCE_BYTES]
            self._derive_keys(self._salt)

    def receive_buffer(self) -> memoryview | None:
        """Where the next body bytes go, for a shell that reads into a buffer (None: use `receive_data`).

        Write at most `len(view)` bytes at its start, release the view, then call `receive_filled(count)`.
        The body grows by at most `RECEIVE_WINDOW` bytes ahead of what arrived, so a header that claims a
        large body makes us hold only what the peer actually sends.
        """
        if self._dead or self._eof or self._body is None or self._buffer or self._filled >= self._body_total:
            return None
        if len(self._body) == self._filled:
            self._reserve(min(RECEIVE_WINDOW, self._body_total - self._filled))
        return memoryview(self._body)[self._filled :]

    def _reserve(self, count: int) -> None:
        """Room for `count` more body bytes: the buffer at least doubles when it grows (never past the
        body's length), so a body costs at most one extra copy in all, whatever the read sizes.
        """
        assert self._body is not None
        needed = self._filled + count
        if needed <= len(self._body):
            return
        assert isinstance(self._body, bytearray)  # a memory-mapped body has its full size from the start
        capacity = min(self._body_total, max(needed, 2 * len(self._body), _FIRST_BODY_BUFFER))
        grown = bytearray(capacity)
        grown[: self._filled] = memoryview(self._body)[: self._filled]
        self._body = grown

    def receive_filled(self, count: int) -> None:
        """`count` bytes were written at the start of `receive_buffer()` (0 means end of stream)."""
        self._ensure_alive()
        if count == 0:
            self.receive_data(b"")
            return
        assert self._body is not None and 0 < count <= len(self._body) - self._filled
        self._filled += count

    def next_event(self) -> Frame | NeedData | Closed:
        """The next verified frame, NEED_DATA, or CLOSED; WireError on any violation."""
        self._ensure_alive()
        if self._peer_nonce is None:
            if self._eof:
                self._fail("handshake", f"peer closed after {len(self._buffer)} of {NONCE_BYTES} nonce bytes")
            return NEED_DATA
        if self._header is None:
            if len(self._buffer) < HEADER_BYTES:
                return self._short(CLOSED if not self._buffer else None)
            self._take_header()
        assert self._header is not None and self._body is not None
        if self._filled < self._body_total:
            return self._short(None)
        header, body, sealed = self._header, self._body, self._sealed
        self._header, self._body, self._sealed, self._filled, self._body_total = None, None, None, 0, 0
        return self._verify(header, body, sealed)

    def start_body(self) -> None:
        """Parse a header that arrived whole (as `next_event` would), so its body goes to `receive_buffer`."""
        self._ensure_alive()
        if self._peer_nonce is not None and self._header is None and len(self._buffer) >= HEADER_BYTES:
            self._take_header()

    def _take_header(self) -> None:
        self._header = self._parse_header()
        del self._buffer[:HEADER_BYTES]
        self._body_total = self._header.body_bytes
        take = min(len(self._buffer), self._body_total)
        if self._recv_seq > 0 and self._body_total >= LARGE_FRAME:
            # An authenticated peer's large frame: one buffer of the body's size, committed page by page
            # as the bytes arrive (no regrowth, no copies), or the buffer of an earlier frame `recycle`d
            # that is large enough (then no longer kept there).
            fits = [index for index, kept in enumerate(self._recycled) if len(kept) >= self._body_total]
            big = memoryview(self._recycled.pop(fits[0])) if fits else _large_buffer(self._body_total)
            self._body = big[: self._body_total]
            self._body[:take] = self._buffer[:take]
        else:
            self._body = bytearray(self._buffer[:take])
        del self._buffer[:take]
        self._filled = take

    def _short(self, at_boundary: Closed | None) -> NeedData | Closed:
        if not self._eof:
            return NEED_DATA
        if at_boundary is not None:
            return at_boundary
        held = len(self._buffer) + self._filled + (HEADER_BYTES if self._header is not None else 0)
        self._fail("truncated", f"peer closed with {held} bytes of an unfinished frame")

    def _parse_header(self) -> FrameHeader:
        first = self._recv_seq == 0  # before the peer's first frame verifies: the pre-authentication caps
        try:
            return parse_header(
                bytes(self._buffer[:HEADER_BYTES]),
                max_payload=self.preauth_max_payload if first else self.max_payload,
                max_tail=self.preauth_max_tail if first else self.max_tail,
                preauth=first,
            )
        except WireError as error:
            self._fail(error.code, error.detail)

    def _verify(self, header: FrameHeader, body: bytearray | memoryview, sealed: memoryview | None) -> Frame:
        assert self._recv_aead is not None
        plain_bytes = header.payload_len + header.tail_len
        nonce = FRAME_NONCE.pack(self._recv_direction, header.seq)
        if sealed is not None:
            # A body that came in one read-only piece is decrypted into a fresh buffer (one pass, no
            # copy of the ciphertext first).
            size = plain_bytes + TAG_BYTES
            body = _large_buffer(size) if size >= LARGE_FRAME else bytearray(size)
        with memoryview(body) as view:
            try:
                if sealed is not None:
                    open_into(self._recv_aead, nonce, sealed, view, plain_bytes, header.raw)
                else:
                    # In place: the plaintext overwrites the ciphertext it came from (the tag stays behind).
                    open_in_place(self._recv_aead, nonce, view, plain_bytes, header.raw)
            except Exception:  # InvalidTag: forged, altered, replayed under another key, or cut
                self._fail(
                    "bad_tag", f"frame authentication failed (kind {header.kind:#06x}, seq {header.seq})"
                )
        if header.seq != self._recv_seq:
            self._fail("replay", f"frame seq {header.seq}, expected {self._recv_seq}: replayed or reordered")
        self._recv_seq += 1
        if self._recv_seq == 1 and self.on_authenticated is not None:
            callback, self.on_authenticated = self.on_authenticated, None
            callback()
        payload = bytes(body[: header.payload_len])
        tail = memoryview(body)[header.payload_len : plain_bytes] if header.tail_len else b""
        frame = Frame(header.kind, header.seq, payload, tail)
        if isinstance(body, memoryview):
            frame.body = body
        return frame

    def recycle(self, frame: Frame) -> None:
        """Give back the buffer of a large frame this connection decrypted: the next large frame is read
        into it (its pages are already mapped, which on a busy host costs more than the copy itself).

        Only once nothing uses the frame any more: not its tail, nor any tensor built over it.
        """
        if frame.body is not None and isinstance(frame.body.obj, mmap.mmap):
            buffer = frame.body.obj
            if len(self._recycled) < RECYCLE_KEEP:
                self._recycled.append(buffer)
            else:  # keep the largest ones
                smallest = min(range(len(self._recycled)), key=lambda index: len(self._recycled[index]))
                if len(self._recycled[smallest]) < len(buffer):
                    self._recycled[smallest] = buffer
        frame.body = None

    # --- sending ---------------------------------------------------------------------------------

    def send_frame(
        self, kind: int, payload: bytes, tail: Tail = b"", *, buffer: bytearray | None = None
    ) -> bytearray | memoryview:
        """The wire bytes of the next frame (header, encrypted payload ‖ tail, tag): a bytearray, or for
        a frame of `LARGE_FRAME` bytes and more a memoryview of an anonymous memory map.

        `tail` may be any contiguous buffer (e.g. a memoryview of a tensor's storage), counted in bytes
        whatever its item format, or a sequence of such buffers: under AES-256-GCM a tail of
        `STREAM_SEAL_MIN` bytes or more is encrypted from where its parts lie straight into the frame;
        otherwise the parts are copied once, side by side, into the frame and encrypted there in place.
        With `buffer` (large enough), the frame is built in it and a view of it is returned: the caller
        must not touch the buffer until the bytes are sent.
        """
        self._ensure_alive()
        if self._send_aead is None:
            raise WireError("handshake", "cannot send before the peer's nonce has arrived")
        if not 0 <= kind <= 0xFFFF:
            raise ValueError(f"frame kind must fit in u16, got {kind}")
        if isinstance(tail, bytes):  # the common case: no view to cast
            parts: list[bytes | memoryview] = [tail] if tail else []
            tail_len = len(tail)
        else:
            views = (
                [memoryview(tail).cast("B")]
                if isinstance(tail, bytearray | memoryview)
                else [memoryview(part).cast("B") for part in tail]
            )
            parts = list(views)
            tail_len = sum(view.nbytes for view in views)
        if len(payload) > self.max_payload:
            raise WireError(
                "too_large", f"payload of {len(payload)} bytes exceeds the cap of {self.max_payload}"
            )
        if tail_len > self.max_tail:
            raise WireError("too_large", f"tail of {tail_len} bytes exceeds the cap of {self.max_tail}")
        if self._send_seq >= self._send_limit:
            raise WireError(
                "closed", "this connection's key has sealed all the frames it may; open a new connection"
            )
        seq = self._send_seq
        header = HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, kind, seq, len(payload), tail_len)
        plain_end = HEADER_BYTES + len(payload) + tail_len
        size = plain_end + TAG_BYTES
        out: bytearray | memoryview
        if buffer is not None and len(buffer) >= size:
            out = memoryview(buffer)[:size]  # the caller's buffer, reused: its pages are already there
        else:
            out = _large_buffer(size) if plain_end >= LARGE_FRAME else bytearray(size)
        out[:HEADER_BYTES] = header
        nonce = FRAME_NONCE.pack(self._send_direction, seq)
        if self._send_key is not None and tail_len >= STREAM_SEAL_MIN:
            with memoryview(out) as view:
                pieces = [memoryview(payload), *(memoryview(part) for part in parts)]
                seal_parts(self._send_key, nonce, header, pieces, view[HEADER_BYTES:])
        else:
            offset = HEADER_BYTES + len(payload)
            out[HEADER_BYTES:offset] = payload
            for part in parts:  # bytes, or a view cast to bytes: len() counts bytes either way
                out[offset : offset + len(part)] = part
                offset += len(part)
            with memoryview(out) as view:
                seal_in_place(self._send_aead, nonce, view[HEADER_BYTES:], plain_end - HEADER_BYTES, header)
        self._send_seq += 1
        return out

    def send_message(
        self, msg: Message, tail: Tail = b"", *, buffer: bytearray | None = None
    ) -> bytearray | memoryview:
        kind, payload = encode_message(msg)
        return self.send_frame(kind, payload, tail, buffer=buffer)

    def rekey(self, salt: bytes) -> None:
        """Switch both directions to the keys of a new salt (same nonces and cipher; seqs continue)."""
        self._ensure_alive()
        if self._send_aead is None:
            raise WireError("handshake", "cannot rekey before the nonce exchange completed")
        self._salt = check_key(salt)
        self._derive_keys(self._salt)

    # --- internals -------------------------------------------------------------------------------

    def _derive_keys(self, key: bytes) -> None:
        assert self._peer_nonce is not None
        dialer, listener = (
            (self._nonce, self._peer_nonce) if self.role is Role.DIALER else (self._peer_nonce, self._nonce)
        )
        suite = choose_suite(dialer, listener)
        self.suite = suite
        self._send_limit = AES_GCM_MAX_FRAMES if suite is Suite.AES_256_GCM else MAX_SEQ + 1
        send_key, recv_key = direction_keys(key, dialer, listener, self.channel, suite, self.role)
        self._send_aead = aead_for(suite, send_key)
        self._send_key = send_key if suite is Suite.AES_256_GCM else None
        self._recv_aead = aead_for(suite, recv_key)

    def _ensure_alive(self) -> None:
        if self._dead:
            raise WireError("closed", "the connection failed earlier and accepts no further use")

    def _fail(self, code: WireErrorCode, detail: str) -> typing.NoReturn:
        self._dead = True
        self._buffer.clear()
        self._body = self._sealed = None
        raise WireError(code, detail)
