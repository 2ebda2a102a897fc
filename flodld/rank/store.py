"""`ControllerStore`: a torch.distributed.Store served by the controller's rendezvous channel.

Ranks pass it to `init_process_group(store=...)` and need nothing but the controller port. torch
calls Store methods synchronously from its own threads, so this client uses a blocking socket
(`BlockingChannel`) guarded by a lock: one request in flight per store object. A broken
connection is re-dialed at most once per call.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from torch._C._distributed_c10d import Store

from flodld.net.blocking import BlockingChannel
from flodld.wire.frames import Frame
from flodld.wire.magic import Channel
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

DEFAULT_TIMEOUT = timedelta(seconds=300)
CONNECT_TIMEOUT_SECS = 10.0
# Extra seconds the socket waits beyond a server-side wait, so the server's timeout answer wins.
REPLY_MARGIN_SECS = 10.0


class StoreRequestError(RuntimeError):
    """The controller refused a store request; `code` is its reason code."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        super().__init__(f"controller store: {reason} [{code}]")


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class ControllerStore(Store):
    """Key/value store on the controller port, authenticated with the run's session salt."""

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
        with self._lock:
            self._connect()

    # --- plumbing ----------------------------------------------------------------------------

    def _connect(self) -> BlockingChannel:
        channel = BlockingChannel.connect(
            self.host, self.port, Channel.RENDEZVOUS, self._salt, timeout=self._connect_timeout
        )
        try:
            channel.send(StoreHello(run_id=self.run_id, rank=self.rank))
            self._expect(channel.recv(self._connect_timeout), StoreOk)
        except BaseException:
            channel.close()
            raise
        self._channel = channel
        return channel

    @staticmethod
    def _expect(frame: Frame, kind: type[Message]) -> Message:
        message = frame.message()
        if isinstance(message, StoreError):
            if message.code == "timeout":
                raise TimeoutError(f"controller store: {message.reason}")
            raise StoreRequestError(message.code, message.reason)
        if not isinstance(message, kind):
            raise StoreRequestError("bad_reply", f"expected {kind.__name__}, got {type(message).__name__}")
        return message

    def _call(self, request: Message, tail: bytes, kind: type[Message], wait_secs: float = 0.0) -> Frame:
        """Send one request, return the reply frame (checked to be `kind`); one re-dial on a broken link."""
        with self._lock:
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
                self._expect(frame, kind)
                return frame
        raise AssertionError("unreachable")

    def _wait_secs(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self._timeout).total_seconds()

    # --- torch.distributed.Store -------------------------------------------------------------

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        self._call(StoreSet(key=key), _as_bytes(value), StoreOk)

    def get(self, key: str) -> bytes:
        wait = self._wait_secs()
        return self._call(StoreGet(key=key, timeout=wait), b"", StoreValue, wait).tail

    def add(self, key: str, amount: int) -> int:
        frame = self._call(StoreAdd(key=key, amount=int(amount)), b"", StoreInt)
        message = frame.message()
        assert isinstance(message, StoreInt)
        return message.value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b = _as_bytes(expected)
        request = StoreCompareSet(key=key, expected_len=len(expected_b))
        return self._call(request, expected_b + _as_bytes(desired), StoreValue).tail

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait = self._wait_secs(timeout)
        self._call(StoreWait(keys=list(keys), timeout=wait), b"", StoreOk, wait)

    def check(self, keys: list[str]) -> bool:
        message = self._call(StoreCheck(keys=list(keys)), b"", StoreBool).message()
        assert isinstance(message, StoreBool)
        return message.value

    def delete_key(self, key: str) -> bool:
        message = self._call(StoreDeleteKey(key=key), b"", StoreBool).message()
        assert isinstance(message, StoreBool)
        return message.value

    def num_keys(self) -> int:
        message = self._call(StoreNumKeys(), b"", StoreInt).message()
        assert isinstance(message, StoreInt)
        return message.value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wait = self._wait_secs()
        frame = self._call(StoreMultiGet(keys=list(keys), timeout=wait), b"", StoreValues, wait)
        message = frame.message()
        assert isinstance(message, StoreValues)
        return split_tail(frame.tail, list(message.lengths))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        encoded = [_as_bytes(v) for v in values]
        if len(keys) != len(encoded):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(encoded)} values")
        self._call(StoreMultiSet(keys=list(keys), lengths=[len(v) for v in encoded]), b"".join(encoded), StoreOk)

    def append(self, key: str, value: bytes | str) -> None:
        self._call(StoreAppend(key=key), _as_bytes(value), StoreOk)

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
