"""The one exception the wire layer raises, with a stable reason code for shells and tests.

Shells branch on `code` (for example: drop silently on `bad_tag`, answer a Reject on `bad_payload`);
humans read `str(error)`.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

WireErrorCode = Literal[
    "bad_magic",
    "bad_version",
    "too_large",
    "bad_tag",
    "replay",
    "handshake",
    "unknown_kind",
    "bad_payload",
    "truncated",
    "closed",
]

WIRE_ERROR_CODES: Final[frozenset[str]] = frozenset(get_args(WireErrorCode))

_DEFAULT_SENTENCES: Final[dict[str, str]] = {
    "bad_magic": "the frame does not start with the flodld frame magic",
    "bad_version": "the frame uses a protocol version this build does not speak",
    "too_large": "the frame is larger than the configured cap",
    "bad_tag": "frame authentication failed (wrong session key, or the frame was altered)",
    "replay": "the frame's sequence number is not the next one (replayed, reordered or dropped frame)",
    "handshake": "the connection handshake did not complete",
    "unknown_kind": "the frame's message kind is not registered",
    "bad_payload": "the frame's payload is not a valid message of its kind",
    "truncated": "the peer closed the connection in the middle of a frame",
    "closed": "the connection is closed after an earlier error",
}


class WireError(Exception):
    """A protocol violation or a dead connection; `code` is one of `WIRE_ERROR_CODES`."""

    code: WireErrorCode

    def __init__(self, code: WireErrorCode, detail: str | None = None) -> None:
        if code not in WIRE_ERROR_CODES:
            raise ValueError(f"unknown wire error code {code!r}; use one of {sorted(WIRE_ERROR_CODES)}")
        self.code = code
        self.detail = detail if detail is not None else _DEFAULT_SENTENCES[code]
        super().__init__(f"{self.detail} [{code}]")
