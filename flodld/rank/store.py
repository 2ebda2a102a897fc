"""`ControllerStore`: a torch.distributed.Store served by the controller's rendezvous channel.

Ranks pass it to `init_process_group(store=...)` and need nothing but the controller port. torch
calls Store methods synchronously from its own threads, so this client uses a blocking socket
(`BlockingChannel`) guarded by a lock: one request in flight per store object. A broken
connection is re-dialed at most once per call; mutating requests carry a request id, so a request
re-sent after a lost reply is answered from the controller's record, never applied twice.

It implements every method of torch 2.13's `torch.distributed.Store` (on older torch the extra methods
are simply there, unused by torch). Errors follow torch: a timeout raises
`torch.distributed.DistStoreError` (here `StoreTimeoutError`, which is also a `TimeoutError`) naming
the timeout; any other refusal raises `StoreRequestError` (a `DistStoreError`, so a `RuntimeError`).

torch's C++ side keeps a Python store only through its C++ half: if the Python object is collected,
calls from C++ fail with "Not implemented". So every `ControllerStore` (and every `clone()`, which
torch's C++ code receives and keeps) stays alive until `close()`.
"""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta
from typing import ClassVar, TypeVar

import torch.distributed as dist

# The public name (torch.distributed.Store); torch re-exports it without `as`, which mypy does not count.
from torch.distributed import Store  # type: ignore[attr-defined]

from flodld.net.blocking import BlockingChannel
from flodld.rank.env import RankEnvironment
from flodld.wire import store as ws
from flodld.wire.frames import MAX_PAYLOAD, Frame
from flodld.wire.magic import Channel
from flodld.wire.messages import Message
from flodld.wire.store import MAX_VALUE_BYTES, split_tail

DEFAULT_TIMEOUT = timedelta(seconds=300)
CONNECT_TIMEOUT_SECS = 10.0
# Extra seconds the socket waits beyond a server-side wait, so the server's timeout answer wins.
REPLY_MARGIN_SECS = 10.0

M = TypeVar("M", bound=Message)

_DistStoreError: type[RuntimeError] = getattr(dist, "DistStoreError", RuntimeError)


class StoreRequestError(_DistStoreError):  # type: ignore[valid-type,misc]
    """The controller refused a store request; `code` is its reason code (a torch DistStoreError)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        super().__init__(f"controller store: {reason} [{code}]")


class StoreTimeoutError(StoreRequestError, TimeoutError):
    """A wait ran out: torch's DistStoreError (a RuntimeError) and Python's TimeoutError at once."""


_QueueEmptyBase: type[RuntimeError] = getattr(dist, "QueueEmptyError", StoreRequestError)


class QueueEmptyError(_QueueEmptyBase):  # type: ignore[valid-type,misc]
    """`queue_pop(key, block=False)` on an empty queue (torch's QueueEmptyError where torch has it)."""


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class ControllerStore(Store):
    """Key/value store on the controller port, authenticated with the run's session salt."""

    _alive: ClassVar[dict[int, ControllerStore]] = {}
    _alive_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        host: str,
        port: int,
        salt: bytes,
        run_id: str,
        *,
        rank: int = -1,
        timeout: timedelta = DEFAULT_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT_SECS,
    ) -> None:
        super().__init__()
        super().set_timeout(timeout)
        self.host, self.port, self.run_id, self.rank = host, port, run_id, rank
        self._salt = salt
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._channel: BlockingChannel | None = None
        self.client_id = secrets.token_hex(16)
        self._next_request_id = 1
        with self._lock:
            self._connect()
        with ControllerStore._alive_lock:
            ControllerStore._alive[id(self)] = self

    @classmethod
    def for_rank(cls, env: RankEnvironment, *, timeout: timedelta = DEFAULT_TIMEOUT) -> ControllerStore:
        """The store of the run `env` belongs to (its controller address, salt and run id), as `env.rank`."""
        return cls(
            env.controller_host, env.controller_port, env.salt, env.run_id, rank=env.rank, timeout=timeout
        )

    # --- plumbing ----------------------------------------------------------------------------

    def _connect(self) -> BlockingChannel:
        channel = BlockingChannel.connect(
            self.host, self.port, Channel.RENDEZVOUS, self._salt, timeout=self._connect_timeout,
            max_payload=MAX_PAYLOAD, max_tail=MAX_VALUE_BYTES,
        )
        try:
            channel.send(ws.StoreHello(run_id=self.run_id, rank=self.rank, client_id=self.client_id))
            self._expect(channel.recv(self._connect_timeout), ws.StoreOk)
        except BaseException:
            channel.close()
            raise
        self._channel = channel
        return channel

    @staticmethod
    def _expect(frame: Frame, kind: type[M]) -> M:
        message = frame.message()
        if isinstance(message, ws.StoreError):
            if message.code == "timeout":
                raise StoreTimeoutError(message.code, message.reason)
            raise StoreRequestError(message.code, message.reason)
        if not isinstance(message, kind):
            raise StoreRequestError("bad_reply", f"expected {kind.__name__}, got {type(message).__name__}")
        return message

    def _request_id(self) -> int:
        """The next id for a mutating request (called under the lock; one id per call, kept on re-send)."""
        request_id = self._next_request_id
        self._next_request_id += 1
        return request_id

    def _call(self, request: Message, tail: bytes, kind: type[M], wait_secs: float = 0.0) -> tuple[M, bytes]:
        """Send one request, return the reply (a `kind`) and its tail; one re-dial on a broken link.

        A mutating request gets its request id here, once: the re-send after a re-dial carries the same id.
        """
        with self._lock:
            if "request_id" in type(request).model_fields:
                request = request.model_copy(update={"request_id": self._request_id()})
            for attempt in (0, 1):
                channel = self._channel or self._connect()
                try:
                    channel.send(request, tail)
                    frame = channel.recv(wait_secs + REPLY_MARGIN_SECS + self._connect_timeout)
                except (EOFError, ConnectionError, BrokenPipeError, OSError) as error:
                    if isinstance(error, TimeoutError):
                        raise
                    channel.close()
                    self._channel = None
                    if attempt:
                        raise ConnectionError(
                            f"controller store at {self.host}:{self.port}: connection lost twice ({error!r})"
                        ) from error
                    continue
                return self._expect(frame, kind), frame.tail
        raise AssertionError("unreachable")

    def _wait_secs(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self._timeout).total_seconds()

    def _int(self, request: Message) -> int:
        return self._call(request, b"", ws.StoreInt)[0].value

    def _bool(self, request: Message) -> bool:
        return self._call(request, b"", ws.StoreBool)[0].value

    # --- torch.distributed.Store -------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        self._call(ws.StoreSet(key=key), _as_bytes(value), ws.StoreOk)

    def get(self, key: str) -> bytes:
        wait = self._wait_secs()
        return self._call(ws.StoreGet(key=key, timeout=wait), b"", ws.StoreValue, wait)[1]

    def add(self, key: str, amount: int) -> int:
        return self._int(ws.StoreAdd(key=key, amount=int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b = _as_bytes(expected)
        request = ws.StoreCompareSet(key=key, expected_len=len(expected_b))
        return self._call(request, expected_b + _as_bytes(desired), ws.StoreValue)[1]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait = self._wait_secs(timeout)
        self._call(ws.StoreWait(keys=list(keys), timeout=wait), b"", ws.StoreOk, wait)

    def check(self, keys: list[str]) -> bool:
        return self._bool(ws.StoreCheck(keys=list(keys)))

    def delete_key(self, key: str) -> bool:
        return self._bool(ws.StoreDeleteKey(key=key))

    def num_keys(self) -> int:
        return self._int(ws.StoreNumKeys())

    # The C++ trampoline looks these two up by their C++ names (PrefixStore over this store calls them).
    getNumKeys = num_keys
    deleteKey = delete_key

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Values of `keys` in order.

        A key named twice is fetched once (the controller refuses duplicates).
        """
        unique = list(dict.fromkeys(keys))
        wait = self._wait_secs()
        message, tail = self._call(ws.StoreMultiGet(keys=unique, timeout=wait), b"", ws.StoreValues, wait)
        values = dict(zip(unique, split_tail(tail, list(message.lengths)), strict=True))
        return [values[key] for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        encoded = [_as_bytes(v) for v in values]
        if len(keys) != len(encoded):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(encoded)} values")
        request = ws.StoreMultiSet(keys=list(keys), lengths=[len(v) for v in encoded])
        self._call(request, b"".join(encoded), ws.StoreOk)

    def append(self, key: str, value: bytes | str) -> None:
        self._call(ws.StoreAppend(key=key), _as_bytes(value), ws.StoreOk)

    def list_keys(self) -> list[str]:
        message, tail = self._call(ws.StoreListKeys(), b"", ws.StoreValues)
        return [piece.decode() for piece in split_tail(tail, list(message.lengths))]

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._call(ws.StoreQueuePush(key=key), _as_bytes(value), ws.StoreOk)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pop the head of queue `key`; block (up to the store timeout) for one, or raise QueueEmptyError."""
        wait = self._wait_secs() if block else 0.0
        try:
            return self._call(ws.StoreQueuePop(key=key, timeout=wait), b"", ws.StoreValue, wait)[1]
        except StoreRequestError as error:
            if error.code == "queue_empty":
                raise QueueEmptyError(f"controller store: queue {key!r} is empty") from None
            raise

    def queue_len(self, key: str) -> int:
        return self._int(ws.StoreQueueLen(key=key))

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """Block until `world_size` callers reached barrier `key` (torch's own Store::barrier scheme)."""
        arrived = self.add(f"{key}/num_members", 1)
        if arrived == world_size:
            self.set(f"{key}/last_member", b"<val_ignored>")
        self.wait([f"{key}/last_member"], timeout)

    def clone(self) -> ControllerStore:
        """A new, independent connection to the same store (its own lock, socket and request ids)."""
        return ControllerStore(
            self.host,
            self.port,
            self._salt,
            self.run_id,
            rank=self.rank,
            timeout=self._timeout,
            connect_timeout=self._connect_timeout,
        )

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        """Close the connection and let the object be collected (torch must be done with it)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
        with ControllerStore._alive_lock:
            ControllerStore._alive.pop(id(self), None)
