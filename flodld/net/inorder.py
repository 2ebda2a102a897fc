"""Batches of sends that leave in the order they were made, whichever task makes them.

A fold hands on chunks in offset order, but a batch may be produced by a deposit's handler, by a leg
closing, or by a timer (the straggler timeout), each in its own task; each batch is sent with awaits in
between, so without a queue a later batch could overtake an earlier one still draining. `InOrder.send`
takes its place in the line at the moment it is called (synchronously, before any await), then waits for
the batch before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


class InOrder:
    def __init__(self) -> None:
        self._tail: asyncio.Future[None] | None = None

    def send(self, items: Iterable[T], one: Callable[[T], Awaitable[None]]) -> Coroutine[Any, Any, None]:
        """A coroutine that sends `items` with `one`, after every batch queued before this call."""
        batch = list(items)
        previous = self._tail
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tail = done

        async def run() -> None:
            try:
                if previous is not None:
                    await asyncio.shield(previous)
                for item in batch:
                    await one(item)
            finally:
                done.set_result(None)
                if self._tail is done:
                    self._tail = None

        return run()
