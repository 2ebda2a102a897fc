"""The rendezvous store service: torch.distributed's key/value store on the controller port.

`KeyValueState` holds the data; this shell speaks the 0x02xx messages on a rendezvous-channel
connection keyed with the session salt (the frame tags are the authentication), and parks
waiters on one asyncio.Condition that every mutation notifies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from flodld.controller.kvstate import KeyValueState, NotAnInteger, StoreFull
from flodld.controller.metrics import ControllerCounters
from flodld.net.stream import FramedStream, accept_channel
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.messages import Message
from flodld.wire.store import (
    StoreAdd,
    StoreAppend,
    StoreBool,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreError,
    StoreGet,
    StoreHello,
    StoreInt,
    StoreMultiGet,
    StoreMultiSet,
    StoreNumKeys,
    StoreOk,
    StoreSet,
    StoreValue,
    StoreValues,
    StoreWait,
    split_tail,
)

log = logging.getLogger("flodld.controller.store")

MAX_VALUE_BYTES = 64 * 1024 * 1024
HELLO_TIMEOUT_SECS = 10.0
CHANNEL = "rendezvous"

Reply = tuple[Message, bytes]


class StoreTimeout(Exception):
    pass


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
    ) -> None:
        self.run_id = run_id
        self.salt = salt
        self.counters = counters or ControllerCounters()
        self.state = state or KeyValueState()
        self.hello_timeout = hello_timeout
        self._changed = asyncio.Condition()
        self._dispatch: dict[type[Message], Callable[[Message, bytes], Awaitable[Reply]]] = {
            StoreSet: self._set,
            StoreGet: self._get,
            StoreAdd: self._add,
            StoreCompareSet: self._compare_set,
            StoreWait: self._wait,
            StoreCheck: self._check,
            StoreDeleteKey: self._delete_key,
            StoreNumKeys: self._num_keys,
            StoreMultiGet: self._multi_get,
            StoreMultiSet: self._multi_set,
            StoreAppend: self._append,
        }

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        where = peer[0] if peer else "?"
        try:
            stream = await accept_channel(reader, writer, self.salt, timeout=self.hello_timeout,
                                          max_tail=MAX_VALUE_BYTES)
            hello = await self._receive(stream, self.hello_timeout)
            message = hello.message()
            if not isinstance(message, StoreHello):
                await self._reply(stream, StoreError(code="bad_request", reason="the first store frame must be StoreHello"))
                return
            if message.run_id != self.run_id:
                self.counters.dropped["rendezvous_wrong_run"] += 1
                log.info("event=store_refused peer=%s reason=wrong_run run_id=%r", where, message.run_id)
                await self._reply(stream, StoreError(
                    code="wrong_run",
                    reason=f"this controller serves run {self.run_id!r}, not {message.run_id!r}; the rank was "
                    "started for another run",
                ))
                return
            await self._reply(stream, StoreOk())
            await self._serve(stream)
        except (EOFError, ConnectionError, asyncio.IncompleteReadError):
            return
        except TimeoutError:
            self.counters.dropped["rendezvous_timeout"] += 1
            log.info("event=store_dropped peer=%s reason=timeout", where)
        except WireError as error:
            # Wrong salt (bad_tag) and garbage land here: drop without a reply, as the join channel does.
            self.counters.dropped[f"rendezvous_{error.code}"] += 1
            log.info("event=store_dropped peer=%s reason=%s detail=%r", where, error.code, error.detail)

    async def _serve(self, stream: FramedStream) -> None:
        while True:
            frame = await self._receive(stream, None)
            try:
                request = frame.message()
                handler = self._dispatch.get(type(request))
                if handler is None:
                    raise ValueError(f"{type(request).__name__} is not a store request")
                reply, tail = await handler(request, frame.tail)
            except WireError as error:
                reply, tail = StoreError(code="bad_request", reason=str(error)[:1024]), b""
            except ValueError as error:
                code = "not_integer" if isinstance(error, NotAnInteger) else "bad_request"
                reply, tail = StoreError(code=code, reason=str(error)[:1024]), b""
            except StoreFull as error:
                reply, tail = StoreError(code="too_large", reason=str(error)[:1024]), b""
            except StoreTimeout as error:
                reply, tail = StoreError(code="timeout", reason=str(error)[:1024]), b""
            await self._reply(stream, reply, tail)

    async def _receive(self, stream: FramedStream, timeout: float | None) -> Frame:
        frame = await stream.recv(timeout)
        self.counters.frame_in(CHANNEL, len(frame.payload) + len(frame.tail))
        return frame

    async def _reply(self, stream: FramedStream, message: Message, tail: bytes = b"") -> None:
        await stream.send(message, tail)
        self.counters.frame_out(CHANNEL, len(tail))

    async def _changed_now(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _until_present(self, keys: list[str], timeout: float) -> None:
        if self.state.has_all(keys):
            return
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.state.has_all(keys)), timeout)
        except TimeoutError:
            missing = [k for k in keys if self.state.get(k) is None]
            raise StoreTimeout(f"timed out after {timeout:g}s waiting for keys {missing[:8]}") from None

    # --- requests ------------------------------------------------------------------------------

    async def _set(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreSet)
        self.state.set(request.key, tail)
        await self._changed_now()
        return StoreOk(), b""

    async def _get(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreGet)
        await self._until_present([request.key], request.timeout)
        value = self.state.get(request.key)
        assert value is not None
        return StoreValue(), value

    async def _add(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreAdd)
        value = self.state.add(request.key, request.amount)
        await self._changed_now()
        return StoreInt(value=value), b""

    async def _compare_set(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreCompareSet)
        if request.expected_len > len(tail):
            raise ValueError(f"expected_len {request.expected_len} exceeds the {len(tail)}-byte tail")
        expected, desired = tail[: request.expected_len], tail[request.expected_len :]
        held = self.state.compare_set(request.key, expected, desired)
        await self._changed_now()
        return StoreValue(), held

    async def _wait(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreWait)
        await self._until_present(list(request.keys), request.timeout)
        return StoreOk(), b""

    async def _check(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreCheck)
        return StoreBool(value=self.state.has_all(list(request.keys))), b""

    async def _delete_key(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreDeleteKey)
        existed = self.state.delete(request.key)
        await self._changed_now()
        return StoreBool(value=existed), b""

    async def _num_keys(self, request: Message, tail: bytes) -> Reply:
        return StoreInt(value=self.state.num_keys()), b""

    async def _multi_get(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreMultiGet)
        keys = list(request.keys)
        await self._until_present(keys, request.timeout)
        values = [self.state.get(k) or b"" for k in keys]
        return StoreValues(lengths=[len(v) for v in values]), b"".join(values)

    async def _multi_set(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreMultiSet)
        if len(request.keys) != len(request.lengths):
            raise ValueError(f"{len(request.keys)} keys but {len(request.lengths)} value lengths")
        self.state.multi_set(list(zip(request.keys, split_tail(tail, list(request.lengths)), strict=True)))
        await self._changed_now()
        return StoreOk(), b""

    async def _append(self, request: Message, tail: bytes) -> Reply:
        assert isinstance(request, StoreAppend)
        self.state.append(request.key, tail)
        await self._changed_now()
        return StoreOk(), b""
