"""Frame codec and per-connection state, in the h11 style: bytes in, events out, no I/O.

Theory of operation:
- The dialer writes the channel magic (its caller does) and a 16-byte nonce; the listener answers with
  its own nonce. Both sides then derive a session key from the run salt, the channel's magic and both
  nonces, so every connection has a key of its own: nothing captured on one connection verifies on
  another, and a connection keyed for one channel never verifies on another.
- Each frame is a 24-byte header, a JSON payload, a raw binary tail and a 16-byte tag. The tag covers a
  direction byte, the whole header (magic and version included), the payload and the tail, so a frame
  cannot be reflected back to its sender, and no header bit can be altered unnoticed.
- Sequence numbers start at 0 in each direction and must increase by exactly one: a replayed,
  reordered or dropped frame is refused (`replay`).
- Caps are checked from the header, before the body is buffered: a peer cannot make us allocate more
  than the caps allow, whatever length it claims.
- The first frame a side receives is held to small pre-authentication caps (`PREAUTH_MAX_PAYLOAD`,
  no tail) until it verifies: a peer that has not proven the key cannot make us buffer more than that.
  After the first frame verifies, the connection's normal caps apply.
- Any violation kills the connection: the error is raised once, and every later call raises
  `WireError("closed")`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Final

from flodld.wire.errors import WireError, WireErrorCode
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import Message, decode_message, encode_message
from flodld.wire.salt import SALT_BYTES

FRAME_MAGIC: Final = 0xF10D17C4
PROTOCOL_VERSION: Final = 1
NONCE_BYTES: Final = 16
TAG_BYTES: Final = 16
MAX_PAYLOAD: Final = 16 * 1024 * 1024
DEFAULT_MAX_TAIL: Final = 1024 * 1024 * 1024
MAX_SEQ: Final = 2**64 - 1

HEADER: Final = struct.Struct("<IHHQII")
HEADER_BYTES: Final = HEADER.size  # 24
SESSION_LABEL: Final = b"flodld/session/v2"
# The first frame a side receives, before anything has proven the peer holds the key: small, no tail.
PREAUTH_MAX_PAYLOAD: Final = 16 * 1024
PREAUTH_MAX_TAIL: Final = 0
# Bound into the session key of a connection made without a channel (in-memory tests); every socket
# adapter in flodld.net passes its channel, whose 4-byte magic goes here instead.
_NO_CHANNEL: Final = b"\x00\x00\x00\x00"
_U32_MAX: Final = 2**32 - 1

BytesLike = bytes | bytearray | memoryview


class Role(Enum):
    DIALER = "dialer"
    LISTENER = "listener"


# The byte each role puts in front of what it MACs: a frame sent by one side never verifies as a
# frame from the other.
_DIRECTION: Final[dict[Role, bytes]] = {Role.DIALER: b"D", Role.LISTENER: b"L"}
_PEER: Final[dict[Role, Role]] = {Role.DIALER: Role.LISTENER, Role.LISTENER: Role.DIALER}


@dataclass(frozen=True)
class Frame:
    """One authenticated frame, in order."""

    kind: int
    seq: int
    payload: bytes
    tail: bytes

    def message(self) -> Message:
        """The payload decoded as the message registered for `kind` (WireError on failure)."""
        return decode_message(self.kind, self.payload)


class NeedData:
    """Sentinel type: feed more bytes with `receive_data` (see `bytes_wanted`)."""

    def __repr__(self) -> str:
        return "NEED_DATA"


class Closed:
    """Sentinel type: the peer closed the connection cleanly, on a frame boundary."""

    def __repr__(self) -> str:
        return "CLOSED"


NEED_DATA: Final = NeedData()
CLOSED: Final = Closed()


def channel_binding(channel: Channel | None) -> bytes:
    """The 4 bytes a channel contributes to its session key: its magic (zeros for no channel)."""
    return _NO_CHANNEL if channel is None else magic_prefix(channel)


def session_key(salt: bytes, dialer_nonce: bytes, listener_nonce: bytes, channel: Channel | None = None) -> bytes:
    """HMAC-SHA256(salt, label ‖ channel magic ‖ dialer nonce ‖ listener nonce): this connection's MAC key."""
    return hmac.digest(salt, SESSION_LABEL + channel_binding(channel) + dialer_nonce + listener_nonce, hashlib.sha256)


def _check_key(key: bytes) -> bytes:
    if len(key) != SALT_BYTES:
        raise ValueError(f"a frame key is a {SALT_BYTES}-byte session salt, got {len(key)} bytes")
    return bytes(key)


@dataclass(frozen=True)
class _Header:
    kind: int
    seq: int
    payload_len: int
    tail_len: int

    @property
    def body_bytes(self) -> int:
        return self.payload_len + self.tail_len + TAG_BYTES


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
    ) -> None:
        if nonce is not None and len(nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        if not 0 <= max_payload <= _U32_MAX or not 0 <= max_tail <= _U32_MAX:
            raise ValueError(f"caps must be in 0..{_U32_MAX} bytes, got payload {max_payload}, tail {max_tail}")
        self.role = role
        self.channel = channel
        self.max_payload = max_payload
        self.max_tail = max_tail
        # Caps of the first received frame: the smaller of the pre-authentication and normal caps.
        self.preauth_max_payload = min(preauth_max_payload, max_payload)
        self.preauth_max_tail = min(preauth_max_tail, max_tail)
        self.on_authenticated = on_authenticated
        self._salt = _check_key(key)
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._peer_nonce: bytes | None = None
        self._key: bytes | None = None
        self._send_seq = 0
        self._recv_seq = 0
        self._buffer = bytearray()
        self._header: _Header | None = None
        self._eof = False
        self._dead = False

    # --- state -----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Both nonces are known, so frames can be sent and verified."""
        return self._key is not None

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
            need = NONCE_BYTES
        elif self._header is None:
            need = HEADER_BYTES
        else:
            need = HEADER_BYTES + self._header.body_bytes
        return max(0, need - len(self._buffer))

    def initial_bytes(self) -> bytes:
        """This side's nonce: the first thing it writes (the dialer writes the channel magic before it)."""
        return self._nonce

    # --- receiving -------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        self._ensure_alive()
        if self._eof:
            if data:
                self._fail("closed", "bytes arrived after end of stream")
            return
        if not data:
            self._eof = True
            return
        self._buffer += data
        if self._peer_nonce is None and len(self._buffer) >= NONCE_BYTES:
            self._peer_nonce = bytes(self._buffer[:NONCE_BYTES])
            del self._buffer[:NONCE_BYTES]
            self._key = self._derive(self._salt)

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
            self._header = self._parse_header()
        header = self._header
        total = HEADER_BYTES + header.body_bytes
        if len(self._buffer) < total:
            return self._short(None)
        frame = self._verify(header, total)
        del self._buffer[:total]
        self._header = None
        return frame

    def _short(self, at_boundary: Closed | None) -> NeedData | Closed:
        if not self._eof:
            return NEED_DATA
        if at_boundary is not None:
            return at_boundary
        self._fail("truncated", f"peer closed with {len(self._buffer)} bytes of an unfinished frame")

    def _parse_header(self) -> _Header:
        magic, version, kind, seq, payload_len, tail_len = HEADER.unpack_from(self._buffer)
        if magic != FRAME_MAGIC:
            self._fail("bad_magic", f"frame magic {magic:#010x} != {FRAME_MAGIC:#010x}")
        if version != PROTOCOL_VERSION:
            self._fail("bad_version", f"frame protocol version {version}, this build speaks {PROTOCOL_VERSION}")
        first = self._recv_seq == 0
        max_payload = self.preauth_max_payload if first else self.max_payload
        max_tail = self.preauth_max_tail if first else self.max_tail
        what = "first frame's (pre-authentication) " if first else ""
        if payload_len > max_payload:
            self._fail(
                "too_large", f"{what}payload of {payload_len} bytes exceeds the cap of {max_payload}; refused unread"
            )
        if tail_len > max_tail:
            self._fail("too_large", f"{what}tail of {tail_len} bytes exceeds the cap of {max_tail}; refused unread")
        return _Header(kind, seq, payload_len, tail_len)

    def _verify(self, header: _Header, total: int) -> Frame:
        assert self._key is not None
        body_end = total - TAG_BYTES
        payload_end = HEADER_BYTES + header.payload_len
        # A memoryview avoids copying large tails, but must be released before the buffer can change.
        with memoryview(self._buffer) as view:
            mac = hmac.new(self._key, _DIRECTION[_PEER[self.role]], hashlib.sha256)
            mac.update(view[:body_end])
            authentic = hmac.compare_digest(mac.digest()[:TAG_BYTES], view[body_end:total])
            payload = bytes(view[HEADER_BYTES:payload_end]) if authentic else b""
            tail = bytes(view[payload_end:body_end]) if authentic else b""
        if not authentic:
            self._fail("bad_tag", f"frame authentication failed (kind {header.kind:#06x}, seq {header.seq})")
        if header.seq != self._recv_seq:
            self._fail("replay", f"frame seq {header.seq}, expected {self._recv_seq}: replayed or reordered")
        self._recv_seq += 1
        if self._recv_seq == 1 and self.on_authenticated is not None:
            callback, self.on_authenticated = self.on_authenticated, None
            callback()
        return Frame(header.kind, header.seq, payload, tail)

    # --- sending ---------------------------------------------------------------------------------

    def send_frame(self, kind: int, payload: bytes, tail: BytesLike = b"") -> bytes:
        """The wire bytes of the next frame (header, payload, tail, tag).

        `tail` may be any contiguous buffer (e.g. a memoryview of a tensor's storage); its size is
        counted in bytes whatever its item format.
        """
        self._ensure_alive()
        if self._key is None:
            raise WireError("handshake", "cannot send before the peer's nonce has arrived")
        if not 0 <= kind <= 0xFFFF:
            raise ValueError(f"frame kind must fit in u16, got {kind}")
        tail_bytes = memoryview(tail).cast("B")
        if len(payload) > self.max_payload:
            raise WireError("too_large", f"payload of {len(payload)} bytes exceeds the cap of {self.max_payload}")
        if tail_bytes.nbytes > self.max_tail:
            raise WireError("too_large", f"tail of {tail_bytes.nbytes} bytes exceeds the cap of {self.max_tail}")
        if self._send_seq > MAX_SEQ:
            raise WireError("closed", "sequence numbers exhausted; open a new connection")
        header = HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, kind, self._send_seq, len(payload), tail_bytes.nbytes)
        mac = hmac.new(self._key, _DIRECTION[self.role], hashlib.sha256)
        for part in (header, payload, tail_bytes):
            mac.update(part)
        self._send_seq += 1
        return b"".join((header, payload, tail_bytes, mac.digest()[:TAG_BYTES]))

    def send_message(self, msg: Message, tail: BytesLike = b"") -> bytes:
        kind, payload = encode_message(msg)
        return self.send_frame(kind, payload, tail)

    def rekey(self, salt: bytes) -> None:
        """Switch both directions to the session key of a new salt (same nonces; seqs continue)."""
        self._ensure_alive()
        if self._key is None:
            raise WireError("handshake", "cannot rekey before the nonce exchange completed")
        self._salt = _check_key(salt)
        self._key = self._derive(self._salt)

    # --- internals -------------------------------------------------------------------------------

    def _derive(self, salt: bytes) -> bytes:
        assert self._peer_nonce is not None
        if self.role is Role.DIALER:
            return session_key(salt, self._nonce, self._peer_nonce, self.channel)
        return session_key(salt, self._peer_nonce, self._nonce, self.channel)

    def _ensure_alive(self) -> None:
        if self._dead:
            raise WireError("closed", "the connection failed earlier and accepts no further use")

    def _fail(self, code: WireErrorCode, detail: str) -> typing.NoReturn:
        self._dead = True
        self._buffer.clear()
        raise WireError(code, detail)
