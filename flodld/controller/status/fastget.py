"""The direct answer to `GET /state.json`: decide from a request head's bytes whether the port may answer it
itself (sans-io: bytes in, a verdict out; the mux's HTTP protocol does the I/O).

Pollers ask for state.json on a new connection each time; through aiohttp every poll costs routing, a
Request, a task and the response machinery, about a tenth of the controller's event loop in a join storm
with eight pollers. The answer itself is bytes the status source already holds (`state_body`), so a
strictly well-formed `GET /state.json` is answered from here, with the same status, headers and body as
the app's handler gives it.

Only the plainest request qualifies: `GET`, the target `/state.json` or `/state.json?members=<value>` (that
one parameter, a value of `[0-9a-z.]` that `parse_members` accepts), HTTP/1.0 or 1.1 (1.1 with a Host
header, which aiohttp requires), each header line a token, a colon and a value of visible ASCII, spaces and
tabs (no obs-fold, no control or 8-bit bytes), at most `MAX_FIELDS` header lines and none named twice, no
Content-Length but `0`, no Transfer-Encoding, Upgrade or Expect, the head ending in CRLF CRLF within
`HEAD_CAP` bytes with nothing after it in the same read. Everything else (another method or path, `/`,
`?token=`, a malformed or oversize head, a pipelined request) goes to aiohttp with every byte read so far,
as every request did before: aiohttp gives each error answer (and counts `http_malformed`), there is one
code path for errors. So does a request whose answer is not a 200 (no state yet: the source returns None;
a bad `members`: `parse_members` refuses it).
"""

from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import dataclass
from email.utils import formatdate
from typing import Final

from aiohttp.http import SERVER_SOFTWARE

from flodld.controller.status.snapshot import BadMembersQuery, MemberRange, parse_members

HEAD_CAP: Final = 8 * 1024
"""A head not complete within this many bytes is aiohttp's to judge (its own limit is 8190 per line)."""
MAX_FIELDS: Final = 64
"""Header lines a direct answer accepts (aiohttp's limit is 128)."""
_MEMBERS_VALUE_MAX: Final = 24  # "A..B" with ten digits each, the most `parse_members` takes
_REQUEST_LINE_MAX: Final = len(b"GET /state.json?members= HTTP/1.1\r\n") + _MEMBERS_VALUE_MAX

_REQUEST_LINE: Final = re.compile(
    rb"GET /state\.json(?:\?members=([0-9a-z.]{0,%d}))? HTTP/1\.([01])\r\n" % _MEMBERS_VALUE_MAX
)
_FIELD: Final = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([\t\x20-\x7e]*)\r\n")
_OUTSIDE: Final = re.compile(rb"[^\t\r\n\x20-\x7e]")  # a byte no line of a direct head has
# Headers that change what aiohttp answers or how it reads on (a body, an upgrade, a 100 Continue).
_HANDED_OVER_FIELDS: Final = frozenset({b"transfer-encoding", b"upgrade", b"expect"})
_SERVER: Final = SERVER_SOFTWARE.encode("ascii")  # aiohttp's own Server header, for the same answer


class Verdict(enum.Enum):
    MORE = "more"
    """The head is not complete yet and may still qualify: read on."""
    HAND_OVER = "hand_over"
    """Not a request answered here: aiohttp gets every byte read so far."""


@dataclass(frozen=True, slots=True)
class Direct:
    """A request to answer directly: the member page it asks for, and its HTTP minor version."""

    members: MemberRange
    minor: int
    """0 or 1: the answer's status line carries the request's version, as aiohttp's does."""


class HeadReader:
    """One connection's request head, judged as its bytes arrive (one at a time or all at once).

    A line is judged when its LF arrives, so the work is linear in the head's size however it is cut:
    before that only the bytes themselves are checked (a control or 8-bit byte, or a request line longer
    than any direct one, hands over at once). A verdict other than `MORE` is final: feed no more.
    """

    def __init__(self) -> None:
        self.head = bytearray()
        """Every byte fed so far: what aiohttp gets on a hand-over."""
        self._judged = 0  # the end of the complete lines judged so far
        self._direct: Direct | None = None  # from the request line, once judged
        self._fields: set[bytes] = set()

    def feed(self, data: bytes) -> Direct | Verdict:
        self.head += data
        if _OUTSIDE.search(data) is not None or len(self.head) > HEAD_CAP:
            return Verdict.HAND_OVER
        if b"\n" not in data:
            waiting_line = self._direct is None and len(self.head) > _REQUEST_LINE_MAX
            return Verdict.HAND_OVER if waiting_line else Verdict.MORE
        head = self.head
        while (lf := head.find(b"\n", self._judged)) >= 0:
            start, end = self._judged, lf + 1
            self._judged = end
            if self._direct is None:
                verdict = _request_line(head, start, end)
                if not isinstance(verdict, Direct):
                    return verdict
                self._direct = verdict
            elif end - start == 2 and head[start] == 0x0D:  # the empty line: the head is complete
                if end != len(head) or (self._direct.minor == 1 and b"host" not in self._fields):
                    return Verdict.HAND_OVER  # something follows; or HTTP/1.1 without Host (aiohttp: 400)
                return self._direct
            elif not self._field(head, start, end):
                return Verdict.HAND_OVER
        return Verdict.MORE

    def _field(self, head: bytearray, start: int, end: int) -> bool:
        field = _FIELD.fullmatch(head, start, end)
        if field is None or len(self._fields) == MAX_FIELDS:
            return False
        name = field[1].lower()
        if name in self._fields or name in _HANDED_OVER_FIELDS:
            return False
        if name == b"content-length" and field[2].strip(b" \t") != b"0":
            return False
        self._fields.add(name)
        return True


def _request_line(head: bytearray, start: int, end: int) -> Direct | Verdict:
    request = _REQUEST_LINE.fullmatch(head, start, end)
    if request is None:
        return Verdict.HAND_OVER
    value = request[1]
    try:
        members = parse_members(None if value is None else value.decode("ascii"))
    except BadMembersQuery:  # aiohttp answers it 400
        return Verdict.HAND_OVER
    return Direct(members, int(request[2]))


def decide(head: bytes) -> Direct | Verdict:
    """The verdict on `head` read at once (`HeadReader` judges a head as it arrives)."""
    return HeadReader().feed(head)


def answer_head(direct: Direct, length: int, date: bytes) -> bytes:
    """The status line and headers of the 200 before a `length`-byte state.json body.

    The same headers, in the same order, as the app's state handler gets from aiohttp (`Date` as `date`).
    """
    return (
        b"HTTP/1.%d 200 OK\r\n"
        b"Cache-Control: no-cache\r\n"
        b"Access-Control-Allow-Origin: *\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n"
        b"Date: %s\r\n"
        b"Server: %s\r\n"
        b"Connection: close\r\n"
        b"\r\n"
    ) % (direct.minor, length, date, _SERVER)


def busy_answer(direct: Direct, retry_after: int, detail: str, date: bytes) -> bytes:
    """The whole 429 to a direct request past the render budget
    (`flodld.controller.status.snapshot.RenderBudget`): the status and body aiohttp's handler gives
    (`flodld.controller.status.page_routes.busy_answer`), closing.
    """
    body = json.dumps({"error": detail, "code": "render_budget"}, separators=(",", ":")).encode()
    return (
        b"HTTP/1.%d 429 Too Many Requests\r\n"
        b"Cache-Control: no-cache\r\n"
        b"Retry-After: %d\r\n"
        b"Content-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n"
        b"Date: %s\r\n"
        b"Server: %s\r\n"
        b"Connection: close\r\n"
        b"\r\n"
        b"%s"
    ) % (direct.minor, retry_after, len(body), date, _SERVER, body)


class HttpDate:
    """The `Date` header's value (RFC 9110 IMF-fixdate), formatted once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self, now: float | None = None) -> bytes:
        second = int(time.time() if now is None else now)
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value
