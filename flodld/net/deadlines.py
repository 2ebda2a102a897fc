"""Per-connection deadlines of one fixed length on one loop timer.

Every connection on the controller port has a deadline or two while it is young (the channel magic within
`magic_deadline`, the join handshake within `handshake_timeout`), and almost every one is met and cancelled.
A loop timer per deadline costs a timer object, a heap insertion and a removal each (about 3 µs per
deadline under uvloop, a few per cent of the controller's CPU in a 10,000-host join storm). All the
deadlines of one length expire in the order they were set, so a queue in arrival order is already sorted:
setting and cancelling are O(1), and one loop timer, armed for the earliest live deadline, serves them all.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger("flodld.net.deadlines")


class Deadline:
    """One deadline: `cancel()` it once it is met (the callback is dropped at once; the queue passes the
    entry over when it reaches the head).
    """

    __slots__ = ("callback", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None

    def cancelled(self) -> bool:
        """Cancelled, or already called."""
        return self.callback is None


class DeadlineQueue:
    """Callbacks due `timeout` s after they were set, in the order they were set, on one loop timer.

    A callback that raises is logged; the others still run. The loop's clock (`loop.time()`) is the one a
    `call_later` of the same length would use, so each callback runs when that timer would have.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"a deadline queue's timeout is > 0 s, got {timeout!r}")
        self.timeout = timeout
        self._loop = loop
        self._entries: deque[Deadline] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Entries held (cancelled ones included until they reach the head and are passed over)."""
        return len(self._entries)

    def call(self, callback: Callable[[], None]) -> Deadline:
        """`callback()` after `timeout` s, unless the returned deadline is cancelled first."""
        entry = Deadline(self._loop.time() + self.timeout, callback)
        self._entries.append(entry)
        if self._timer is None:
            self._timer = self._loop.call_at(entry.when, self._fire)
        return entry

    def close(self) -> None:
        """Cancel every deadline and the loop timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for entry in self._entries:
            entry.callback = None
        self._entries.clear()

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        entries = self._entries
        while entries:
            head = entries[0]
            callback = head.callback
            if callback is not None and head.when > now:
                self._timer = self._loop.call_at(head.when, self._fire)
                return
            entries.popleft()
            if callback is None:
                continue
            head.callback = None
            try:
                callback()
            except Exception:
                log.exception("event=deadline_callback_failed")
