"""The rendezvous store service: torch.distributed's key/value store on the controller port.

`KeyValueState` holds the data; this shell speaks the 0x02xx messages on a rendezvous-channel
connection keyed with the session salt (the frame tags are the authentication). Mutations are
applied synchronously and wake every waiter through one event that is swapped on each change.

Replies are capped like requests: no reply tail exceeds `MAX_VALUE_BYTES`, and a request whose answer
would (a `multi_get` of many large values, a long `list_keys`) gets `StoreError(too_large)` with the
size computed before anything is joined; the connection keeps serving. A `multi_get` naming a key twice
is refused (`duplicate_key`), so a small request cannot make the controller copy one value many times.

Mutating requests carry a `request_id` per client (`StoreHello.client_id`); `RequestLedger` remembers
each client's last answered id and reply, so a request re-sent after a lost reply is answered from the
record instead of being applied twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Final

from flodld.controller.kvstate import KeyValueState, NotAnInteger, StoreFull
from flodld.controller.status.metrics import ControllerCounters
from flodld.net.stream import FramedStream, accept_channel
from flodld.wire import store as ws
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.handlers import HandlerTable
from flodld.wire.messages import MAX_LIST_ITEMS, Message
from flodld.wire.store import MAX_VALUE_BYTES, split_tail

log = logging.getLogger("flodld.controller.store")

__all__ = ["MAX_VALUE_BYTES", "RequestLedger", "StoreService"]

HELLO_TIMEOUT_SECS = 10.0
CHANNEL = "rendezvous"
# Request-id records: at most this many clients, and this many bytes of remembered reply tails.
LEDGER_MAX_CLIENTS = 4096
LEDGER_MAX_BYTES = 64 * 1024 * 1024
# A reply up to this size is handed to the socket without waiting for it to drain when nothing of the
# previous reply is still queued: at most one small reply is ever buffered per connection, and the
# next reply waits (under the write-stall timeout) if the client stopped reading.
NOWAIT_REPLY_BYTES = 64 * 1024

Reply = tuple[Message, bytes]

# The field-less replies, built once (messages are frozen): most requests are answered with one of them.
_OK: Final = ws.StoreOk()
_VALUE: Final = ws.StoreValue()


class StoreTimeout(Exception):
    pass


class Refused(Exception):
    """A request answered with StoreError(code) without touching the store."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class RequestLedger:
    """Each client's last answered mutating request: (request id, reply, tail). Pure and bounded.

    One request is in flight per client (the rank's store holds a lock), so the last reply is all a
    re-send can need. Least recently used clients are forgotten first once `max_clients` or
    `max_bytes` (remembered tails) is exceeded; a forgotten client's re-send is applied again.
    """

    def __init__(self, max_clients: int = LEDGER_MAX_CLIENTS, max_bytes: int = LEDGER_MAX_BYTES) -> None:
        self.max_clients = max_clients
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, tuple[int, Message, bytes]] = OrderedDict()
        self._bytes = 0
        self.replayed = 0

    def lookup(self, client: str, request_id: int) -> Reply | None:
        """The remembered reply when `request_id` is the client's last; None when it is new.

        Raises Refused(stale_request) for an id older than the last one answered.
        """
        record = self._last.get(client)
        if record is None or request_id > record[0]:
            return None
        if request_id < record[0]:
            raise Refused(
                "stale_request",
                f"request id {request_id} is older than this client's last answered request {record[0]}",
            )
        self._last.move_to_end(client)
        self.replayed += 1
        return record[1], record[2]

    def answered(self, client: str, request_id: int) -> bool:
        """Whether `request_id` (or a later request) of `client` has been answered already."""
        record = self._last.get(client)
        return record is not None and request_id <= record[0]

    def remember(self, client: str, request_id: int, reply: Message, tail: bytes) -> None:
        old = self._last.pop(client, None)
        if old is not None:
            self._bytes -= len(old[2])
        self._last[client] = (request_id, reply, tail)
        self._bytes += len(tail)
        while self._last and (len(self._last) > self.max_clients or self._bytes > self.max_bytes):
            _, (_, _, dropped) = self._last.popitem(last=False)
            self._bytes -= len(dropped)

    def __len__(self) -> int:
        return len(self._last)


class StoreService:
    """One run's store; `handle` is the mux handler for the rendezvous channel."""

    def __init__(
        self,
        run_id: str,
        salt: bytes,
        counters: ControllerCounters | None = None,
        *,
        state: KeyValueState | None = None,
        hello_timeout: float = HELLO_TIMEOUT_SECS,
        max_reply_bytes: int = MAX_VALUE_BYTES,
        ledger: RequestLedger | None = None,
    ) -> None:
        self.run_id = run_id
        self.salt = salt
        self.counters = counters or ControllerCounters()
        self.state = state or KeyValueState()
        self.hello_timeout = hello_timeout
        self.max_reply_bytes = max_reply_bytes
        self.ledger = ledger or RequestLedger()
        self._changed = asyncio.Event()
        # Mutations: applied synchronously, so applying and recording the reply never interleave.
        self._apply: HandlerTable[[bytes], Reply] = HandlerTable("store mutation")
        self._apply.register(ws.StoreSet, self._set)
        self._apply.register(ws.StoreAdd, self._add)
        self._apply.register(ws.StoreCompareSet, self._compare_set)
        self._apply.register(ws.StoreDeleteKey, self._delete_key)
        self._apply.register(ws.StoreMultiSet, self._multi_set)
        self._apply.register(ws.StoreAppend, self._append)
        self._apply.register(ws.StoreQueuePush, self._queue_push)
        self._query: HandlerTable[[], Awaitable[Reply]] = HandlerTable("store request")
        self._query.register(ws.StoreGet, self._get)
        self._query.register(ws.StoreWait, self._wait)
        self._query.register(ws.StoreCheck, self._check)
        self._query.register(ws.StoreNumKeys, self._num_keys)
        self._query.register(ws.StoreMultiGet, self._multi_get)
        self._query.register(ws.StoreListKeys, self._list_keys)
        self._query.register(ws.StoreQueueLen, self._queue_len)
        # The kinds that carry a request id (answered once per id: `RequestLedger`).
        self._deduplicated = frozenset([*self._apply, ws.StoreQueuePop])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        where = peer[0] if peer else "?"
        try:
            stream = await accept_channel(reader, writer, self.salt, timeout=self.hello_timeout,
                                          max_tail=self.max_reply_bytes)
            hello = await self._receive(stream, self.hello_timeout)
            message = hello.message()
            if not isinstance(message, ws.StoreHello):
                refusal = ws.StoreError(code="bad_request", reason="the first store frame must be StoreHello")
                await self._reply(stream, refusal)
                return
            if message.run_id != self.run_id:
                self.counters.dropped["rendezvous_wrong_run"] += 1
                log.info("event=store_refused peer=%s reason=wrong_run run_id=%r", where, message.run_id)
                await self._reply(
                    stream,
                    ws.StoreError(
                        code="wrong_run",
                        reason=f"this controller serves run {self.run_id!r}, not {message.run_id!r}; "
                        "the rank was started for another run",
                    ),
                )
                return
            await self._reply(stream, ws.StoreOk())
            await self._serve(stream, message.client_id)
        except (EOFError, ConnectionError, asyncio.IncompleteReadError):
            return
        except TimeoutError:
            self.counters.dropped["rendezvous_timeout"] += 1
            log.info("event=store_dropped peer=%s reason=timeout", where)
        except WireError as error:
            # Wrong salt (bad_tag) and garbage land here: drop without a reply, as the join channel does.
            self.counters.dropped[f"rendezvous_{error.code}"] += 1
            log.info("event=store_dropped peer=%s reason=%s detail=%r", where, error.code, error.detail)

    async def _serve(self, stream: FramedStream, client: str) -> None:
        counters, transport = self.counters, stream.writer.transport
        while True:
            frame = await stream.recv(None)
            request_tail = frame.tail
            counters.frame_in(CHANNEL, len(frame.payload) + len(request_tail))
            try:
                reply, tail = await self._answer(frame.message(), request_tail, client)
            except WireError as error:
                reply, tail = ws.StoreError(code="bad_request", reason=str(error)[:1024]), b""
            except Refused as error:
                reply, tail = ws.StoreError(code=error.code, reason=str(error)[:1024]), b""
            except ValueError as error:
                code = "not_integer" if isinstance(error, NotAnInteger) else "bad_request"
                reply, tail = ws.StoreError(code=code, reason=str(error)[:1024]), b""
            except StoreFull as error:
                reply, tail = ws.StoreError(code="too_large", reason=str(error)[:1024]), b""
            except StoreTimeout as error:
                reply, tail = ws.StoreError(code="timeout", reason=str(error)[:1024]), b""
            if len(tail) > self.max_reply_bytes:  # a last guard: answer, never drop the connection
                reply, tail = (
                    ws.StoreError(
                        code="too_large",
                        reason=(
                            f"the reply would carry {len(tail)} bytes, over the {self.max_reply_bytes}-byte "
                            "cap"
                        ),
                    ),
                    b"",
                )
            if len(tail) <= NOWAIT_REPLY_BYTES and not transport.get_write_buffer_size():
                stream.send_nowait(reply, tail)  # `_reply`'s first branch, without a coroutine per request
                counters.frame_out(CHANNEL, len(tail))
            else:
                await self._reply(stream, reply, tail)

    async def _answer(self, request: Message, tail: bytes, client: str) -> Reply:
        kind = type(request)
        request_id: int = getattr(request, "request_id", 0) if client and kind in self._deduplicated else 0
        if request_id:
            replay = self.ledger.lookup(client, request_id)
            if replay is not None:
                return replay
        if isinstance(request, ws.StoreQueuePop):
            return await self._queue_pop(request, client, request_id)
        if kind in self._apply:
            reply = self._apply.dispatch(request, tail)
            if request_id:
                self.ledger.remember(client, request_id, *reply)
            return reply
        return await self._query.dispatch(request)  # Unhandled (a ValueError) answers bad_request

    async def _receive(self, stream: FramedStream, timeout: float | None) -> Frame:
        frame = await stream.recv(timeout)
        self.counters.frame_in(CHANNEL, len(frame.payload) + len(frame.tail))
        return frame

    async def _reply(self, stream: FramedStream, message: Message, tail: bytes = b"") -> None:
        if len(tail) <= NOWAIT_REPLY_BYTES and not stream.writer.transport.get_write_buffer_size():
            stream.send_nowait(message, tail)
        else:
            await stream.send(message, tail)
        self.counters.frame_out(CHANNEL, len(tail))

    def _notify(self) -> None:
        """Wake every waiter (synchronously: a mutation never yields before its reply is recorded)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        if ready():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreTimeout(f"wait timeout after {round(timeout * 1000)}ms, {what()}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    async def _until_values(self, keys: list[str], timeout: float) -> None:
        def missing() -> str:
            return f"keys: {[k for k in keys if not self.state.has_value(k)][:8]}"

        await self._until(lambda: all(self.state.has_value(k) for k in keys), timeout, missing)

    # --- mutations (synchronous) -------------------------------------------------------------------

    def _set(self, request: ws.StoreSet, tail: bytes) -> Reply:
        self.state.set(request.key, tail)
        self._notify()
        return _OK, b""

    def _add(self, request: ws.StoreAdd, tail: bytes) -> Reply:
        value = self.state.add(request.key, request.amount)
        self._notify()
        return ws.StoreInt(value=value), b""

    def _compare_set(self, request: ws.StoreCompareSet, tail: bytes) -> Reply:
        if request.expected_len > len(tail):
            raise ValueError(f"expected_len {request.expected_len} exceeds the {len(tail)}-byte tail")
        expected, desired = tail[: request.expected_len], tail[request.expected_len :]
        held = self.state.compare_set(request.key, expected, desired)
        self._notify()
        return _VALUE, held

    def _delete_key(self, request: ws.StoreDeleteKey, tail: bytes) -> Reply:
        existed = self.state.delete(request.key)
        self._notify()
        return ws.StoreBool(value=existed), b""

    def _multi_set(self, request: ws.StoreMultiSet, tail: bytes) -> Reply:
        if len(request.keys) != len(request.lengths):
            raise ValueError(f"{len(request.keys)} keys but {len(request.lengths)} value lengths")
        self.state.multi_set(list(zip(request.keys, split_tail(tail, list(request.lengths)), strict=True)))
        self._notify()
        return _OK, b""

    def _append(self, request: ws.StoreAppend, tail: bytes) -> Reply:
        self.state.append(request.key, tail)
        self._notify()
        return _OK, b""

    def _queue_push(self, request: ws.StoreQueuePush, tail: bytes) -> Reply:
        self.state.queue_push(request.key, tail)
        self._notify()
        return _OK, b""

    async def _queue_pop(self, request: ws.StoreQueuePop, client: str, request_id: int) -> Reply:
        key = request.key
        if request.timeout > 0:
            # A re-sent pop waits beside the original, still parked on the dead connection: whichever wakes
            # first pops and records the reply, and the other one answers from that record.
            await self._until(
                lambda: (
                    self.state.queue_len(key) > 0
                    or (request_id > 0 and self.ledger.answered(client, request_id))
                ),
                request.timeout,
                lambda: f"queue: {key!r}",
            )
            if request_id:
                replay = self.ledger.lookup(client, request_id)
                if replay is not None:
                    return replay
        value = self.state.queue_pop(key)
        if value is None:
            raise Refused("queue_empty", f"queue {key!r} is empty")
        self._notify()
        reply: Reply = (_VALUE, value)
        if request_id:
            self.ledger.remember(client, request_id, *reply)
        return reply

    # --- queries ---------------------------------------------------------------------------------

    async def _get(self, request: ws.StoreGet) -> Reply:
        value = self.state.get(request.key)
        if value is None:
            await self._until_values([request.key], request.timeout)
            value = self.state.get(request.key)
            assert value is not None
        return _VALUE, value

    async def _wait(self, request: ws.StoreWait) -> Reply:
        keys = list(request.keys)

        def missing() -> str:
            return f"keys: {[k for k in keys if not self.state.present(k)][:8]}"

        await self._until(lambda: self.state.has_all(keys), request.timeout, missing)
        return _OK, b""

    async def _check(self, request: ws.StoreCheck) -> Reply:
        return ws.StoreBool(value=self.state.has_all(list(request.keys))), b""

    async def _num_keys(self, request: ws.StoreNumKeys) -> Reply:
        return ws.StoreInt(value=self.state.num_keys()), b""

    async def _multi_get(self, request: ws.StoreMultiGet) -> Reply:
        keys = list(request.keys)
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                raise Refused(
                    "duplicate_key", f"multi_get names {key!r} more than once; ask for each key once"
                )
            seen.add(key)
        await self._until_values(keys, request.timeout)
        lengths = [len(self.state.get(k) or b"") for k in keys]
        if sum(lengths) > self.max_reply_bytes:  # sized before anything is copied
            raise Refused(
                "too_large",
                (
                    f"multi_get of {len(keys)} keys would return {sum(lengths)} bytes, over the "
                    f"{self.max_reply_bytes}-byte reply cap; fetch the keys in smaller groups"
                ),
            )
        return ws.StoreValues(lengths=lengths), b"".join(self.state.get(k) or b"" for k in keys)

    async def _list_keys(self, request: ws.StoreListKeys) -> Reply:
        keys = [k.encode() for k in self.state.list_keys()]
        total = sum(len(k) for k in keys)
        if len(keys) > MAX_LIST_ITEMS or total > self.max_reply_bytes:
            raise Refused(
                "too_large",
                (
                    f"list_keys: {len(keys)} keys ({total} bytes) exceed what one reply carries "
                    f"({MAX_LIST_ITEMS} keys, {self.max_reply_bytes} bytes)"
                ),
            )
        return ws.StoreValues(lengths=[len(k) for k in keys]), b"".join(keys)

    async def _queue_len(self, request: ws.StoreQueueLen) -> Reply:
        return ws.StoreInt(value=self.state.queue_len(request.key)), b""
