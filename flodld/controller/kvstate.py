"""The rendezvous store's data: a bounded bytes-to-bytes map with torch.distributed.Store semantics.

Pure and synchronous; waiting for keys is the service's job. Integers for `add` are stored
as ASCII decimal, the representation torch's own stores use, so a rank may `get` a counter.
FIFO queues (`queue_push`/`queue_pop`) live beside the plain keys; `check`/`wait` count a
non-empty queue as present, as torch's stores do. Keys, values and queued items all count
against one byte budget, and no single value may exceed `max_value_bytes`.
"""

from __future__ import annotations

from collections import deque

from flodld.wire.store import MAX_VALUE_BYTES

MAX_STORE_BYTES = 256 * 1024 * 1024


class StoreFull(Exception):
    """Storing the value would exceed the run's store budget, or the per-value cap."""


class NotAnInteger(ValueError):
    """`add` on a key whose value is not a decimal integer."""


class KeyValueState:
    """Keys and values of one run. Every mutation bumps `version` so waiters know to re-check."""

    def __init__(self, max_bytes: int = MAX_STORE_BYTES, max_value_bytes: int = MAX_VALUE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.max_value_bytes = max_value_bytes
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._bytes = 0
        self.version = 0

    def _check_value(self, key: str, length: int) -> None:
        if length > self.max_value_bytes:
            raise StoreFull(
                f"a {length}-byte value under {key!r} exceeds the per-value cap of {self.max_value_bytes} "
                "bytes"
            )

    def _store(self, key: str, value: bytes) -> None:
        self._check_value(key, len(value))
        old = self._data.get(key)
        new_total = self._bytes - (len(key) + len(old) if old is not None else 0) + len(key) + len(value)
        if new_total > self.max_bytes:
            raise StoreFull(
                f"storing {len(value)} bytes under {key!r} would exceed the store budget of {self.max_bytes} "
                "bytes"
            )
        self._data[key] = value
        self._bytes = new_total
        self.version += 1

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def set(self, key: str, value: bytes) -> None:
        self._store(key, value)

    def multi_set(self, items: list[tuple[str, bytes]]) -> None:
        for key, value in items:
            self._check_value(key, len(value))
        extra = sum(len(k) + len(v) for k, v in items)
        if self._bytes + extra > self.max_bytes:
            raise StoreFull(
                f"multi_set of {extra} bytes would exceed the store budget of {self.max_bytes} bytes"
            )
        for key, value in items:
            self._store(key, value)

    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def has_value(self, key: str) -> bool:
        return key in self._data

    def present(self, key: str) -> bool:
        """What `check`/`wait` see: a plain key, or a non-empty queue."""
        return key in self._data or bool(self._queues.get(key))

    def has_all(self, keys: list[str]) -> bool:
        return all(self.present(key) for key in keys)

    def add(self, key: str, amount: int) -> int:
        current = self._data.get(key, b"0")
        try:
            value = int(current.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise NotAnInteger(f"add on {key!r}: its value is not a decimal integer") from None
        if not -(2**63) <= value < 2**63:
            raise NotAnInteger(f"add on {key!r}: the sum {value} leaves the signed 64-bit range torch uses")
        self._store(key, str(value).encode("ascii"))
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Compare-and-set with torch semantics: absent + empty `expected` creates; a match swaps; returns
        what is held now (for an absent key with non-empty `expected`, `expected` itself, as torch does).
        """
        current = self._data.get(key)
        if current is None:
            if expected == b"":
                self._store(key, desired)
                return desired
            return expected
        if current == expected:
            self._store(key, desired)
            return desired
        return current

    def append(self, key: str, value: bytes) -> None:
        current = self._data.get(key, b"")
        self._check_value(key, len(current) + len(value))  # before building the joined value
        self._store(key, current + value)

    def delete(self, key: str) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        self._bytes -= len(key) + len(old)
        self.version += 1
        return True

    def num_keys(self) -> int:
        return len(self._data)

    def list_keys(self) -> list[str]:
        return list(self._data)

    # --- queues ---------------------------------------------------------------------------------

    def queue_push(self, key: str, value: bytes) -> None:
        self._check_value(key, len(value))
        queue = self._queues.get(key)
        extra = len(value) + (0 if queue else len(key))
        if self._bytes + extra > self.max_bytes:
            raise StoreFull(
                f"queueing {len(value)} bytes on {key!r} would exceed the store budget of {self.max_bytes} "
                "bytes"
            )
        self._queues.setdefault(key, deque()).append(value)
        self._bytes += extra
        self.version += 1

    def queue_pop(self, key: str) -> bytes | None:
        """The head of queue `key`, removed; None when the queue is empty or absent."""
        queue = self._queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        self._bytes -= len(value)
        if not queue:
            del self._queues[key]
            self._bytes -= len(key)
        self.version += 1
        return value

    def queue_len(self, key: str) -> int:
        return len(self._queues.get(key, ()))
