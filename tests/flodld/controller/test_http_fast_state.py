"""Issue 18: a plain `GET /state.json` is answered by the port itself from the source's cached bytes, with
the answer aiohttp gives; everything else (and every error) still goes to aiohttp with every byte read.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from flodld.config.join import JoinConfig
from flodld.controller.mux import PortMux
from flodld.controller.run import Controller, serve_http
from flodld.controller.status.fastget import (
    HEAD_CAP,
    MAX_FIELDS,
    Direct,
    HeadReader,
    HttpDate,
    Verdict,
    decide,
)
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.status.snapshot import ALL_MEMBERS, DEFAULT_MEMBERS
from tests.flodld.controller.agents import options, server_transports

POLL = b"GET /state.json HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"  # bench/join_storm.py's poll
BROWSER = (
    b"GET /state.json HTTP/1.1\r\nHost: 127.0.0.1:1337\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\n"
    b"Accept: */*\r\nAccept-Language: en-US,en;q=0.5\r\nAccept-Encoding: gzip, deflate, br\r\n"
    b"Referer: http://127.0.0.1:1337/status\r\nSec-Fetch-Dest: empty\r\nSec-Fetch-Mode: cors\r\n"
    b"Sec-Fetch-Site: same-origin\r\nCache-Control: no-cache\r\nX-Empty:\r\nX-Tab:\tvalue\t\r\n\r\n"
)
MANY_FIELDS = b"GET /state.json HTTP/1.1\r\nHost: t\r\n" + b"".join(
    b"X-%d: 1\r\n" % i for i in range(MAX_FIELDS - 1)
)


def _get(target: bytes, *fields: bytes, version: bytes = b"1.1", host: bool = True) -> bytes:
    """A GET head with `fields` (after `Host: t` unless `host` is false)."""
    lines = ([b"Host: t"] if host else []) + list(fields)
    return b"GET %s HTTP/%s\r\n%s\r\n" % (target, version, b"".join(f + b"\r\n" for f in lines))


def _sized(size: int) -> bytes:
    """A plain state.json head of exactly `size` bytes (one long header)."""
    head = _get(b"/state.json", b"X: " + b"a" * (size - len(_get(b"/state.json", b"X: "))))
    assert len(head) == size
    return head


# --- the decider -------------------------------------------------------------------------------------

DIRECT = {
    "poll": (POLL, DEFAULT_MEMBERS, 1),
    "http-1.0-no-fields": (b"GET /state.json HTTP/1.0\r\n\r\n", DEFAULT_MEMBERS, 0),
    "http-1.0-host": (_get(b"/state.json", version=b"1.0"), DEFAULT_MEMBERS, 0),
    "host-only": (_get(b"/state.json"), DEFAULT_MEMBERS, 1),
    "host-lowercase-no-space": (b"GET /state.json HTTP/1.1\r\nhost:t\r\n\r\n", DEFAULT_MEMBERS, 1),
    "members-all": (_get(b"/state.json?members=all"), ALL_MEMBERS, 1),
    "members-range": (_get(b"/state.json?members=500..999"), (500, 1000), 1),
    "members-one": (_get(b"/state.json?members=0..0", b"Content-Length: 0"), (0, 1), 1),
    "members-empty": (_get(b"/state.json?members="), DEFAULT_MEMBERS, 1),
    "content-length-0": (_get(b"/state.json", b"Content-Length:  0 "), DEFAULT_MEMBERS, 1),
    "browser": (BROWSER, DEFAULT_MEMBERS, 1),
    "max-fields": (MANY_FIELDS + b"\r\n", DEFAULT_MEMBERS, 1),
    "at-head-cap": (_sized(HEAD_CAP), DEFAULT_MEMBERS, 1),
}

HANDED_OVER = {
    "head": b"HEAD /state.json HTTP/1.1\r\nHost: t\r\n\r\n",
    "post": b"POST /state.json HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    "post-start": b"POST /start HTTP/1.1\r\nHost: t\r\nX-Flodld-Start: 1\r\nConnection: close\r\n\r\n",
    "root": _get(b"/"),
    "metrics": _get(b"/metrics"),
    "http-1.1-without-host": b"GET /state.json HTTP/1.1\r\n\r\n",
    "http-1.1-without-host-other-fields": _get(b"/state.json", b"Connection: close", host=False),
    "lowercase-method": b"get /state.json HTTP/1.1\r\n\r\n",
    "other-path": _get(b"/state.jsonx"),
    "sub-path": _get(b"/state.json/"),
    "upper-path": _get(b"/STATE.JSON"),
    "absolute-form": _get(b"http://t/state.json"),
    "token": _get(b"/state.json?token=x"),
    "token-after-members": _get(b"/state.json?members=0..1&token=x"),
    "members-twice": _get(b"/state.json?members=0..1&members=2..3"),
    "members-percent-encoded": _get(b"/state.json?members=%30..1"),
    "members-bad-range": _get(b"/state.json?members=5..2"),
    "members-bad-word": _get(b"/state.json?members=some"),
    "members-too-long": _get(b"/state.json?members=" + b"1" * 30),
    "members-no-value": _get(b"/state.json?members"),
    "empty-query": _get(b"/state.json?"),
    "fragment": _get(b"/state.json#x"),
    "http-2": _get(b"/state.json", version=b"2.0"),
    "http-1.2": _get(b"/state.json", version=b"1.2"),
    "double-space": b"GET  /state.json HTTP/1.1\r\n\r\n",
    "trailing-space": b"GET /state.json HTTP/1.1 \r\n\r\n",
    "bare-lf-request-line": b"GET /state.json HTTP/1.1\nHost: t\n\n",
    "bare-lf-field": b"GET /state.json HTTP/1.1\r\nHost: t\n\r\n",
    "bare-cr": b"GET /state.json HTTP/1.1\r\nHost: t\rX: y\r\n\r\n",
    "obs-fold": b"GET /state.json HTTP/1.1\r\nHost: t\r\nX: a\r\n b\r\n\r\n",
    "space-before-colon": _get(b"/state.json", b"Host : t"),
    "no-colon": _get(b"/state.json", b"Host t"),
    "empty-name": _get(b"/state.json", b": t"),
    "nul": _get(b"/state.json", b"Host: t\x00x"),
    "8-bit": _get(b"/state.json", b"X: caf\xc3\xa9"),
    "del": _get(b"/state.json", b"X: a\x7f"),
    "content-length": _get(b"/state.json", b"Content-Length: 5") + b"12345",
    "content-length-00": _get(b"/state.json", b"Content-Length: 00"),
    "content-length-twice": _get(b"/state.json", b"Content-Length: 0", b"content-length: 0"),
    "transfer-encoding": _get(b"/state.json", b"Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "upgrade": _get(b"/state.json", b"Connection: Upgrade", b"Upgrade: websocket"),
    "expect": _get(b"/state.json", b"Expect: 100-continue"),
    "host-twice": _get(b"/state.json", b"HOST: b"),
    "too-many-fields": MANY_FIELDS + b"X-Last: 1\r\n\r\n",
    "oversize": _get(b"/state.json", b"X: " + b"a" * HEAD_CAP),
    "over-head-cap": _sized(HEAD_CAP + 1),
    "body-after-head": POLL + b"x",
    "pipelined": POLL + POLL,
    "long-request-line-unfinished": b"GET /state.json?members=" + b"1" * 60,
}


@pytest.mark.parametrize(("head", "members", "minor"), list(DIRECT.values()), ids=list(DIRECT))
def test_a_plain_get_of_state_json_is_answered_directly(
    head: bytes, members: tuple[int, int], minor: int
) -> None:
    assert decide(head) == Direct(members, minor)


@pytest.mark.parametrize("head", list(HANDED_OVER.values()), ids=list(HANDED_OVER))
def test_anything_else_is_handed_to_aiohttp(head: bytes) -> None:
    assert decide(head) is Verdict.HAND_OVER


def _fed_byte_by_byte(head: bytes) -> list[Direct | Verdict]:
    reader, verdicts = HeadReader(), []
    for i in range(len(head)):
        verdicts.append(reader.feed(head[i : i + 1]))
        if verdicts[-1] is not Verdict.MORE:
            break
    assert reader.head == head[: len(verdicts)]  # every byte read is kept for aiohttp
    return verdicts


@pytest.mark.parametrize("head", [h for h, _, _ in DIRECT.values()], ids=list(DIRECT))
def test_a_direct_head_arriving_a_byte_at_a_time_is_judged_only_when_complete(head: bytes) -> None:
    verdicts = _fed_byte_by_byte(head)
    assert verdicts[:-1] == [Verdict.MORE] * (len(head) - 1) and verdicts[-1] == decide(head)


# Bytes after a complete head are only seen when they come in the same read; arriving later, the head
# alone is answered and the connection closes (as aiohttp answers the first request of a pipeline).
SPLIT_APART = {k: v for k, v in HANDED_OVER.items() if k not in ("body-after-head", "pipelined")}


@pytest.mark.parametrize("head", list(SPLIT_APART.values()), ids=list(SPLIT_APART))
def test_a_handed_over_head_arriving_a_byte_at_a_time_is_handed_over_no_later_than_whole(head: bytes) -> None:
    verdicts = _fed_byte_by_byte(head)
    assert verdicts[-1] is Verdict.HAND_OVER and set(verdicts[:-1]) <= {Verdict.MORE}


@pytest.mark.parametrize(
    "partial",
    [b"", b"G", b"GET /state.json", b"GET /state.json HTTP/1.1\r", b"GET /state.json HTTP/1.1\r\nHost: t\r\n",
     b"GET /state.json HTTP/1.1\r\nHost: t\r\n\r"],
)  # fmt: skip
def test_an_unfinished_head_waits_for_more(partial: bytes) -> None:
    assert decide(partial) is Verdict.MORE


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (b"GET /state.json HTTP/1.1\r\nX:\x01", b""),  # a control byte: at once, not at the line's end
        (b"GET /state.json?members=1", b"1" * 60),  # longer than any direct request line
        (b"GET /state.json HTTP/1.1\r\nX: ", b"a" * HEAD_CAP),  # over the cap, unfinished
        (b"GET /nope HTTP/1.1\r\n", b""),  # the request line decides
        (b"GET /state.json HTTP/1.1\r\nHost : t\r\n", b""),  # a bad line decides
    ],
)
def test_what_cannot_become_a_direct_head_is_handed_over_without_waiting_for_its_end(
    first: bytes, then: bytes
) -> None:
    reader = HeadReader()
    verdict = reader.feed(first)
    if then:
        assert verdict is Verdict.MORE or first.endswith(b"\x01")
        verdict = verdict if verdict is Verdict.HAND_OVER else reader.feed(then)
    assert verdict is Verdict.HAND_OVER


def test_the_date_header_is_an_imf_fixdate_formatted_once_a_second() -> None:
    date = HttpDate()
    assert date(0.0) == b"Thu, 01 Jan 1970 00:00:00 GMT"
    first = date(1_800_000_000.1)
    assert first == b"Fri, 15 Jan 2027 08:00:00 GMT" and date(1_800_000_000.9) is first
    assert date(1_800_000_001.0) == b"Fri, 15 Jan 2027 08:00:01 GMT"


# --- over real sockets ---------------------------------------------------------------------------------


class FactoryCalls:
    """Counts how often the port asks aiohttp's server for a connection protocol."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original: Callable[[web.Server], object] = web.Server.__call__

        def counted(server: web.Server) -> object:
            self.count += 1
            return original(server)

        monkeypatch.setattr(web.Server, "__call__", counted)


@asynccontextmanager
async def _two_ports(**overrides: object) -> AsyncIterator[tuple[Controller, int, int]]:
    """A started controller (its port answers state.json directly) and a second port serving the same app
    and source with the direct path off; the state cache holds one build for the test's length.
    """
    controller = Controller(options(capacity=2, **overrides))
    _, port = await controller.start()
    controller.state_cache.interval = 3600.0  # one build: both ports give the same bytes
    plain = PortMux(ControllerCounters())
    runner = await serve_http(controller, plain, plain.counters)
    plain.set_http(runner.server)  # the same app, without the direct path
    _, plain_port = await plain.start("127.0.0.1", 0)
    try:
        yield controller, port, plain_port
    finally:
        await plain.close()
        await runner.cleanup()
        await controller.close()


async def _raw(port: int, request: bytes, *, piecewise: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if piecewise:
            for i in range(len(request)):
                writer.write(request[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.002)
        else:
            writer.write(request)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


_HEAD_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+): ?(.*)")
_IMF_FIXDATE = re.compile(
    rb"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} "
    rb"\d\d:\d\d:\d\d GMT"
)


def _parsed(response: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    """(status line, header (name, value) pairs in order, body)."""
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    fields = []
    for line in lines:
        match = _HEAD_LINE.fullmatch(line)
        assert match is not None, line
        fields.append((match[1], match[2]))
    return status, fields, body


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.mark.parametrize("request_bytes", [head for head, _, _ in DIRECT.values()], ids=list(DIRECT))
async def test_the_direct_answer_is_the_one_aiohttp_gives(
    request_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = FactoryCalls(monkeypatch)
    async with _two_ports() as (_, port, plain_port):
        direct = _parsed(await _raw(port, request_bytes))
        assert calls.count == 0, "answered by aiohttp, not directly"
        answered = _parsed(await _raw(plain_port, request_bytes))
        assert calls.count == 1
    assert direct[0] == answered[0] and direct[0].endswith(b" 200 OK")
    assert direct[2] == answered[2] and direct[2].startswith(b'{"')
    assert [name for name, _ in direct[1]] == [name for name, _ in answered[1]]  # the same headers, in order
    without_date = [[(n, v) for n, v in fields if n != b"Date"] for fields in (direct[1], answered[1])]
    assert without_date[0] == without_date[1]
    dates = [v for fields in (direct[1], answered[1]) for n, v in fields if n == b"Date"]
    assert len(dates) == 2 and all(_IMF_FIXDATE.fullmatch(date) for date in dates)
    assert dict(direct[1])[b"Content-Length"] == b"%d" % len(direct[2])


# Every handed-over request that ends (an unfinished one waits for the lifetime, as before) and that the
# mux routes to HTTP at all (not "get "); some answers named, the rest as aiohttp gives them on a port
# without the direct path.
FALLBACKS = {
    k: v for k, v in HANDED_OVER.items() if k not in ("long-request-line-unfinished", "lowercase-method")
}
FALLBACK_ANSWERS = {
    "head": (200, None),
    "post": (404, None),
    "metrics": (200, None),
    "pipelined": (400, None),  # aiohttp: "Data after `Connection: close`"
    "post-start": (409, "auto_mode"),
    "root": (200, None),
    "members-bad-range": (400, "bad_members"),
    "members-percent-encoded": (200, None),
    "token": (200, None),
    "token-after-members": (200, None),
    "http-1.1-without-host": (400, None),
    "space-before-colon": (400, None),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
async def test_every_other_request_gets_aiohttps_answer_from_every_byte_sent(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    request_bytes = FALLBACKS[name]
    calls = FactoryCalls(monkeypatch)
    async with _two_ports() as (_, port, plain_port):
        response = await _raw(port, request_bytes)
        assert calls.count == 1
        answered = await _raw(plain_port, request_bytes)
    assert _parsed(response)[0] == _parsed(answered)[0]
    assert len(re.findall(rb"(?m)^HTTP/\d\.\d [2-5]\d\d ", response)) == 1  # one answer per connection
    status, code = FALLBACK_ANSWERS.get(name, (None, None))
    if status is not None:
        assert _status(response) == status
    if code is not None:
        assert json.loads(_parsed(response)[2])["code"] == code


async def test_state_json_is_answered_without_aiohttp_and_counted_as_an_http_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = FactoryCalls(monkeypatch)
    async with _two_ports() as (controller, port, _):
        before = controller.counters.connections["http"]
        for _ in range(3):
            assert _status(await _raw(port, POLL)) == 200
        assert calls.count == 0
        assert controller.counters.connections["http"] == before + 3
        assert _status(await _raw(port, _get(b"/nope"))) == 404  # and the count does see aiohttp's
        assert calls.count == 1


@pytest.mark.parametrize(
    "request_bytes",
    [HANDED_OVER["space-before-colon"], HANDED_OVER["obs-fold"], HANDED_OVER["bare-lf-request-line"],
     HANDED_OVER["nul"], HANDED_OVER["oversize"] + b"\r\n"],
    ids=["space-before-colon", "obs-fold", "bare-lf", "nul", "oversize"],
)  # fmt: skip
async def test_a_malformed_head_gets_aiohttps_400_and_is_counted(
    request_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = FactoryCalls(monkeypatch)
    async with _two_ports() as (controller, port, _):
        assert _status(await _raw(port, request_bytes)) == 400
        assert calls.count == 1
        assert controller.counters.dropped["http_malformed"] == 1


async def test_before_there_is_state_aiohttp_answers_503(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = FactoryCalls(monkeypatch)
    controller = Controller(options(capacity=1, join=JoinConfig(start="manual")))
    _, port = await controller.listen()
    try:
        response = await _raw(port, POLL)
        assert _status(response) == 503 and b"no membership state published yet" in response
        assert calls.count == 1
    finally:
        await controller.close()


async def test_a_head_arriving_a_byte_at_a_time_is_answered_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = FactoryCalls(monkeypatch)
    async with _two_ports() as (_, port, plain_port):
        direct = _parsed(await _raw(port, POLL, piecewise=True))
        assert calls.count == 0
        answered = _parsed(await _raw(plain_port, POLL))
    assert direct[0] == answered[0] and direct[2] == answered[2]


async def test_a_slow_head_is_still_cut_at_the_http_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = FactoryCalls(monkeypatch)
    async with _two_ports(http_lifetime=0.4) as (controller, port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /state.json HTTP/1.1\r\nX-Slow: ")  # and never finish the head
        try:
            assert await asyncio.wait_for(reader.read(), 3) == b""
        except ConnectionResetError:
            pass
        writer.close()
        assert controller.counters.dropped["http_lifetime"] == 1
        assert calls.count == 0  # it never reached aiohttp


async def test_directly_answered_connections_are_released_before_their_lifetime_ends() -> None:
    """The lifetime timer is cancelled when a directly answered connection ends (it would hold it)."""
    async with _two_ports(http_lifetime=60) as (controller, port, _):
        before = server_transports(port)
        for _ in range(40):
            assert _status(await _raw(port, POLL)) == 200
        await asyncio.sleep(0.05)
        assert server_transports(port) <= before + 2
        assert controller.counters.dropped["http_lifetime"] == 0
