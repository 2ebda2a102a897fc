"""The agent's loopback TCPStore endpoint: what a stock env:// `init_process_group()` dials.

torch's env:// rendezvous opens a TCPStore client to MASTER_ADDR:MASTER_PORT. The agent points that
at 127.0.0.1:<port> (flodld.agent.spawn.torchrun_environment), and this shell answers every request
from the controller's store over the authenticated rendezvous channel (the run's salt, the same
channel `flodld.rank.store.ControllerStore` uses): one controller link per TCPStore connection, so a
blocking WAIT on one never holds up another. The bytes are decoded and encoded by the sans-io codec
`flodld.wire.tcpstore`.

Who may connect: the listener binds 127.0.0.1 only, and a connection is served only when the peer's
socket belongs to the agent's own uid (looked up in /proc/net/tcp{,6}: the peer socket's entry is the
one whose local address is the connection's remote end); any other uid, or a peer not found, is
closed before a byte is read. Its first request must be torch's VALIDATE (magic 0x3C85F7CE), which
also turns away a web page that posts to the loopback port. Nothing unauthenticated leaves the host:
the endpoint's only onward traffic is the authenticated rendezvous channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, get_args

from flodld.net.peeruid import socket_owner_uid
from flodld.net.stream import FramedStream, open_channel
from flodld.wire import store as ws
from flodld.wire import tcpstore as ts
from flodld.wire.errors import WireError
from flodld.wire.frames import MAX_PAYLOAD, Frame
from flodld.wire.magic import Channel
from flodld.wire.messages import Message
from flodld.wire.store import MAX_VALUE_BYTES, split_tail

log = logging.getLogger("flodld.agent.tcpstore")

CONNECT_TIMEOUT_SECS = 10.0
WAIT_SLICE_SECS = 5.0
"""A WAIT is asked of the controller in slices: a canceled wait leaves at most this much behind there."""
MAX_CONNECTIONS = 1024
READ_CHUNK = 256 * 1024

M = TypeVar("M", bound=Message)
_Found = TypeVar("_Found")  # what one slice of a long wait found (`_Session._in_slices`)


# --- the controller side -----------------------------------------------------------------------


class StoreRefused(Exception):
    """The controller answered StoreError; `code` says why. The TCPStore client is then dropped."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{reason} [{code}]")
        self.code = code


@dataclass(frozen=True)
class ControllerAddress:
    host: str
    port: int
    salt: bytes
    run_id: str


class ControllerLink:
    """One authenticated rendezvous connection, dialed on first use and re-dialed once when it breaks.

    Mutating requests carry this link's request ids under its own client id, so one re-sent after a lost
    reply is answered from the controller's record, never applied twice (as ControllerStore does).
    """

    def __init__(self, address: ControllerAddress) -> None:
        self.address = address
        self.client_id = secrets.token_hex(16)
        self._next_id = 1
        self._stream: FramedStream | None = None

    async def _dial(self) -> FramedStream:
        a = self.address
        stream = await open_channel(a.host, a.port, Channel.RENDEZVOUS, a.salt, timeout=CONNECT_TIMEOUT_SECS,
                                    max_payload=MAX_PAYLOAD, max_tail=MAX_VALUE_BYTES)  # fmt: skip
        try:
            await stream.send(ws.StoreHello(run_id=a.run_id, rank=-1, client_id=self.client_id))
            _check(await stream.recv(CONNECT_TIMEOUT_SECS), ws.StoreOk)
        except BaseException:
            stream.close()
            raise
        self._stream = stream
        return stream

    async def call(self, request: Message, kind: type[M], tail: bytes = b"") -> tuple[M, bytes]:
        """Send `request`; the reply (checked to be a `kind`) and its tail. One re-dial on a broken link."""
        if "request_id" in type(request).model_fields:
            request = request.model_copy(update={"request_id": self._next_id})
            self._next_id += 1
        for attempt in (0, 1):
            stream = self._stream or await self._dial()
            try:
                await stream.send(request, tail)
                frame = await stream.recv()
            except (EOFError, ConnectionError) as error:
                self.drop()
                if attempt:
                    raise ConnectionError(f"controller store: connection lost twice ({error!r})") from error
                continue
            return _check(frame, kind), frame.tail
        raise AssertionError("unreachable")

    def drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _check(frame: Frame, kind: type[M]) -> M:
    message = frame.message()
    if isinstance(message, ws.StoreError):
        raise StoreRefused(message.code, message.reason)
    if not isinstance(message, kind):
        raise StoreRefused("bad_reply", f"expected {kind.__name__}, got {type(message).__name__}")
    return message


# --- the node rank (torchrun's GROUP_RANK) -------------------------------------------------------

GROUP_PREFIX = "__flodld/group/"
GROUP_TIMEOUT_SECS = 10.0


async def node_rank(address: ControllerAddress, *, first_rank: int, local_size: int, world_size: int,
                    timeout: float = GROUP_TIMEOUT_SECS) -> tuple[int, int]:  # fmt: skip
    """This host's index among the world's hosts and the number of hosts.

    They are torchrun's GROUP_RANK and GROUP_WORLD_SIZE.

    Formation tells a host its ranks, not its index, so the agents work it out in the run's store: each
    publishes its first rank and rank count, adds its count to a total, and the one that completes the
    world marks it done; then every host counts the hosts whose first rank is below its own (hosts hold
    contiguous rank ranges). A few store round trips; TimeoutError when a host never publishes.
    """
    link = ControllerLink(address)
    try:
        async with asyncio.timeout(timeout):
            await link.call(
                ws.StoreSet(key=f"{GROUP_PREFIX}host/{first_rank}"), ws.StoreOk, str(local_size).encode()
            )
            added = ws.StoreAdd(key=f"{GROUP_PREFIX}ranks", amount=local_size)
            total = (await link.call(added, ws.StoreInt))[0].value
            if total == world_size:
                await link.call(ws.StoreSet(key=f"{GROUP_PREFIX}done"), ws.StoreOk, b"1")
            await link.call(ws.StoreWait(keys=[f"{GROUP_PREFIX}done"], timeout=timeout), ws.StoreOk)
            listed, tail = await link.call(ws.StoreListKeys(), ws.StoreValues)
    finally:
        link.drop()
    keys = [piece.decode() for piece in split_tail(tail, list(listed.lengths))]
    firsts = sorted(int(key.rsplit("/", 1)[1]) for key in keys if key.startswith(f"{GROUP_PREFIX}host/"))
    return firsts.index(first_rank), len(firsts)


# --- one TCPStore client -----------------------------------------------------------------------


class _Session:
    """Serves one TCPStore client connection: requests in order, a WAIT cancelable by CANCEL_WAIT."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: ControllerLink
    ) -> None:
        self.reader, self.writer, self.link = reader, writer, link
        self.codec = ts.TcpStoreServerConnection()
        self.requests: asyncio.Queue[ts.Request | None] = asyncio.Queue(maxsize=64)
        # The keys of the WAIT answered last, when it was the previous request: torch's client sends a
        # blocking queue_pop(key) as WAIT [key] then QUEUE_POP key, and such a pop must not come back
        # empty when another consumer took the item that ended the wait.
        self.waited: tuple[str, ...] | None = None
        self.held: list[ts.Request | None] = []  # a request a wait took off the queue but did not act on

    async def _read(self) -> None:
        """Decode requests into the queue (None at EOF or on a protocol error, which ends the session)."""
        try:
            while True:
                data = await self.reader.read(READ_CHUNK)
                self.codec.receive_data(data)
                while (request := self.codec.next_request()) is not None:
                    await self.requests.put(request)
                if not data:
                    break
        except ts.TcpStoreProtocolError as error:
            log.info("event=tcpstore_dropped reason=protocol detail=%s", error)
        except (ConnectionError, OSError):
            pass
        await self.requests.put(None)

    async def run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        try:
            while (request := self.held.pop() if self.held else await self.requests.get()) is not None:
                reply = await self._answer(request)
                if reply:
                    self.writer.write(reply)
                    await self.writer.drain()
        except StoreRefused as error:
            log.info("event=tcpstore_dropped reason=store detail=%s", error)
        except (ConnectionError, OSError, TimeoutError, WireError) as error:
            log.info("event=tcpstore_dropped reason=link detail=%r", error)
        except Exception as error:  # a boundary: one client's failure never reaches the agent
            log.warning("event=tcpstore_dropped reason=error detail=%r", error)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.link.drop()

    async def _answer(self, request: ts.Request) -> bytes:
        """One request's reply (b"" for the requests torch's client expects no answer to)."""
        waited, self.waited = self.waited, None
        if isinstance(request, ts.QueuePop) and waited == (request.key,):
            return await self._blocking_pop(request.key)
        handler = _HANDLERS.get(type(request))
        if handler is None:
            raise AssertionError(f"unhandled {request!r}")
        return await handler(self, request)

    # One handler per request type (the table `_HANDLERS` below dispatches on the decoded type).

    async def _on_validate(self, request: ts.Validate) -> bytes:
        return b""

    async def _on_ping(self, request: ts.Ping) -> bytes:
        return ts.reply_ping(request.nonce)

    async def _on_set(self, request: ts.Set) -> bytes:
        await self.link.call(ws.StoreSet(key=request.key), ws.StoreOk, request.value)
        return b""

    async def _on_compare_set(self, request: ts.CompareSet) -> bytes:
        compare = ws.StoreCompareSet(key=request.key, expected_len=len(request.expected))
        _, held = await self.link.call(compare, ws.StoreValue, request.expected + request.desired)
        return ts.reply_value(held)

    async def _on_get(self, request: ts.Get) -> bytes:
        return ts.reply_value(
            (await self.link.call(ws.StoreGet(key=request.key, timeout=0), ws.StoreValue))[1]
        )

    async def _on_add(self, request: ts.Add) -> bytes:
        added, _ = await self.link.call(ws.StoreAdd(key=request.key, amount=request.amount), ws.StoreInt)
        return ts.reply_int(added.value)

    async def _on_check(self, request: ts.Check) -> bytes:
        present, _ = await self.link.call(ws.StoreCheck(keys=list(request.keys)), ws.StoreBool)
        return ts.reply_check(present.value)

    async def _on_wait(self, request: ts.Wait) -> bytes:
        reply = await self._wait(list(request.keys))
        if reply == ts.reply_stop_waiting():
            self.waited = tuple(request.keys)
        return reply

    async def _on_num_keys(self, request: ts.NumKeys) -> bytes:
        return ts.reply_int((await self.link.call(ws.StoreNumKeys(), ws.StoreInt))[0].value)

    async def _on_delete_key(self, request: ts.DeleteKey) -> bytes:
        deleted = (await self.link.call(ws.StoreDeleteKey(key=request.key), ws.StoreBool))[0]
        return ts.reply_deleted(deleted.value)

    async def _on_append(self, request: ts.Append) -> bytes:
        await self.link.call(ws.StoreAppend(key=request.key), ws.StoreOk, request.value)
        return b""

    async def _on_multi_get(self, request: ts.MultiGet) -> bytes:
        unique = list(dict.fromkeys(request.keys))
        found, tail = await self.link.call(ws.StoreMultiGet(keys=unique, timeout=0), ws.StoreValues)
        values = dict(zip(unique, split_tail(tail, list(found.lengths)), strict=True))
        return ts.reply_values([values[key] for key in request.keys])

    async def _on_multi_set(self, request: ts.MultiSet) -> bytes:
        multi_set = ws.StoreMultiSet(keys=list(request.keys), lengths=[len(v) for v in request.values])
        await self.link.call(multi_set, ws.StoreOk, b"".join(request.values))
        return b""

    async def _on_cancel_wait(self, request: ts.CancelWait) -> bytes:
        return ts.reply_wait_canceled()  # no wait pending (it answered already): just acknowledge

    async def _on_queue_push(self, request: ts.QueuePush) -> bytes:
        await self.link.call(ws.StoreQueuePush(key=request.key), ws.StoreOk, request.value)
        return b""

    async def _on_queue_pop(self, request: ts.QueuePop) -> bytes:
        """A non-blocking pop (no WAIT before it): an empty queue answers "no item"."""
        try:
            popped = await self.link.call(ws.StoreQueuePop(key=request.key, timeout=0), ws.StoreValue)
        except StoreRefused as error:
            if error.code == "queue_empty":
                return ts.reply_queue_pop(None)
            raise
        return ts.reply_queue_pop(popped[1])

    async def _on_queue_len(self, request: ts.QueueLen) -> bytes:
        return ts.reply_int((await self.link.call(ws.StoreQueueLen(key=request.key), ws.StoreInt))[0].value)

    async def _on_list_keys(self, request: ts.ListKeys) -> bytes:
        listed, tail = await self.link.call(ws.StoreListKeys(), ws.StoreValues)
        return ts.reply_keys([piece.decode() for piece in split_tail(tail, list(listed.lengths))])

    async def _wait(self, keys: list[str]) -> bytes:
        """WAIT: ask the controller in slices until every key exists, or until the client sends CANCEL_WAIT.

        A cancel answers WAIT_CANCELED at once and drops the controller link (its slice is left to time out
        there); the link is re-dialed for the next request.
        """

        async def drop_slice(slice_call: asyncio.Future[bool | None]) -> None:
            slice_call.cancel()
            with contextlib.suppress(asyncio.CancelledError, StoreRefused, ConnectionError, OSError):
                await slice_call
            self.link.drop()

        def canceled(following: ts.Request | None) -> bytes:
            if isinstance(following, ts.CancelWait):
                return ts.reply_wait_canceled()
            # Only CANCEL_WAIT may follow a WAIT (torch's client holds its op lock while waiting).
            raise StoreRefused("protocol", f"{type(following).__name__} sent while a WAIT was pending")

        return await self._in_slices(
            lambda: self._wait_slice(keys), lambda _: ts.reply_stop_waiting(), drop_slice, canceled
        )

    async def _blocking_pop(self, key: str) -> bytes:
        """A blocking QUEUE_POP (after its WAIT): pop from the controller in slices until an item comes.

        As torch's own server, each blocked consumer gets an item: one whose WAIT was ended by an item
        another consumer then took keeps waiting instead of answering "empty". The client sends nothing
        while it waits; at its EOF the slice in flight is let finish, and an item it took is pushed back
        so that it is not lost.
        """

        async def finish_slice(slice_call: asyncio.Future[bytes | None]) -> None:
            value = await slice_call  # the client spoke or left: finish the slice, keep its item
            if value is not None:
                await self.link.call(ws.StoreQueuePush(key=key), ws.StoreOk, value)

        def refused(following: ts.Request | None) -> bytes:
            what = "EOF" if following is None else type(following).__name__
            raise StoreRefused("protocol", f"{what} while a blocking QUEUE_POP was pending")

        return await self._in_slices(lambda: self._pop_slice(key), ts.reply_queue_pop, finish_slice, refused)

    async def _in_slices(
        self,
        one_slice: Callable[[], Awaitable[_Found | None]],
        answer: Callable[[_Found], bytes],
        settle: Callable[[asyncio.Future[_Found | None]], Awaitable[None]],
        interrupted: Callable[[ts.Request | None], bytes],
    ) -> bytes:
        """Run `one_slice` again and again (None: nothing yet) until it finds something, which `answer`
        encodes, or until the client sends its next request (or leaves): then `settle` deals with the slice
        in flight and `interrupted` answers that request, or raises. `_wait` and `_blocking_pop`.
        """
        next_request = asyncio.ensure_future(self.requests.get())
        acted = False  # whether the request that interrupted the wait was answered here
        try:
            while True:
                slice_call = asyncio.ensure_future(one_slice())
                await asyncio.wait({slice_call, next_request}, return_when=asyncio.FIRST_COMPLETED)
                if slice_call.done():
                    found = slice_call.result()
                    if found is not None:
                        return answer(found)
                    continue
                await settle(slice_call)
                acted = True
                return interrupted(next_request.result())
        finally:
            self._hold_unanswered(next_request, acted)

    def _hold_unanswered(self, next_request: asyncio.Future[ts.Request | None], acted: bool) -> None:
        """After a wait: stop reading for it, or keep what it read and did not act on for `run` to answer
        next (a CANCEL_WAIT or the EOF that came just as the wait ended: dropped, the client would wait
        for its answer forever, or the session would never see its end).
        """
        if not next_request.done():
            next_request.cancel()
        elif not next_request.cancelled() and not acted:
            self.held.append(next_request.result())

    async def _pop_slice(self, key: str) -> bytes | None:
        try:
            _, value = await self.link.call(ws.StoreQueuePop(key=key, timeout=WAIT_SLICE_SECS), ws.StoreValue)
        except StoreRefused as error:
            if error.code in ("timeout", "queue_empty"):
                return None
            raise
        return value

    async def _wait_slice(self, keys: list[str]) -> bool | None:
        """True once every key exists; None when the slice timed out first."""
        try:
            await self.link.call(ws.StoreWait(keys=keys, timeout=WAIT_SLICE_SECS), ws.StoreOk)
        except StoreRefused as error:
            if error.code == "timeout":
                return None
            raise
        return True


# Request type -> the `_Session` method answering it (QUEUE_POP after a WAIT goes to `_blocking_pop`).
_HANDLERS: dict[type[ts.Request], Callable[[_Session, Any], Awaitable[bytes]]] = {
    ts.Validate: _Session._on_validate,
    ts.Ping: _Session._on_ping,
    ts.Set: _Session._on_set,
    ts.CompareSet: _Session._on_compare_set,
    ts.Get: _Session._on_get,
    ts.Add: _Session._on_add,
    ts.Check: _Session._on_check,
    ts.Wait: _Session._on_wait,
    ts.NumKeys: _Session._on_num_keys,
    ts.DeleteKey: _Session._on_delete_key,
    ts.Append: _Session._on_append,
    ts.MultiGet: _Session._on_multi_get,
    ts.MultiSet: _Session._on_multi_set,
    ts.CancelWait: _Session._on_cancel_wait,
    ts.QueuePush: _Session._on_queue_push,
    ts.QueuePop: _Session._on_queue_pop,
    ts.QueueLen: _Session._on_queue_len,
    ts.ListKeys: _Session._on_list_keys,
}
assert set(_HANDLERS) == set(get_args(ts.Request)), "every TCPStore request type has its handler"


# --- the endpoint ------------------------------------------------------------------------------


class AgentStoreEndpoint:
    """The per-host loopback TCPStore endpoint of one run (see the module docstring for who may connect)."""

    def __init__(self, address: ControllerAddress, *, say: Callable[[str], None] | None = None,
                 uid: int | None = None) -> None:  # fmt: skip
        self.address = address
        self.say = say
        self.uid = os.getuid() if uid is None else uid
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "127.0.0.1") -> int:
        """Listen on `host` (loopback), on a free port; returns the port."""
        self._server = await asyncio.start_server(self._accept, host, 0, backlog=256, limit=READ_CHUNK)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer, ours = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        owner = socket_owner_uid((peer[0], peer[1]), (ours[0], ours[1])) if peer and ours else None
        if owner != self.uid or len(self._sessions) >= MAX_CONNECTIONS:
            self.refused += 1
            if self.say is not None:
                why = (
                    f"its socket belongs to uid {owner}"
                    if owner is not None
                    else "its socket's owner is unknown"
                )
                if owner == self.uid:
                    why = f"{MAX_CONNECTIONS} connections are open already"
                self.say(f"refused a connection to the rank store endpoint from {peer[0]}:{peer[1]}: {why} "
                         f"(only uid {self.uid} may use it)")  # fmt: skip
            writer.close()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sessions.add(task)
        try:
            await _Session(reader, writer, ControllerLink(self.address)).run()
        finally:
            self._sessions.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._sessions):
            task.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)
