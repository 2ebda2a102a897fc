"""Handler tables keyed by message type, for the loops that read frames (relay, controller data plane).

Each handler is registered with the message class it takes and is typed for it, so a handler never
re-checks its message's type. A handler returns True to end the loop that dispatches to it. A frame whose
message has no handler goes to the table's `unhandled` (default: ignored, as the loops always did).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, cast

from flodld.wire.frames import Frame
from flodld.wire.messages import Message

Context = TypeVar("Context")
M = TypeVar("M", bound=Message)
Outcome = bool | None
Handler = Callable[[Context, M, Frame], Awaitable[Outcome]]


class Dispatch(Generic[Context]):
    """`table.on(HostFrame, handler)`; then `await table(context, frame)` per frame (True: stop reading)."""

    def __init__(
        self, unhandled: Callable[[Context, Message, Frame], Awaitable[Outcome]] | None = None
    ) -> None:
        self._handlers: dict[type[Message], Callable[[Context, Any, Frame], Awaitable[Outcome]]] = {}
        self._unhandled = unhandled

    def on(
        self, kind: type[M], handler: Callable[[Context, M, Frame], Awaitable[Outcome]]
    ) -> Dispatch[Context]:
        if kind in self._handlers:
            raise ValueError(f"{kind.__name__} already has a handler")
        self._handlers[kind] = cast(Callable[[Context, Any, Frame], Awaitable[Outcome]], handler)
        return self

    def kinds(self) -> frozenset[type[Message]]:
        return frozenset(self._handlers)

    async def __call__(self, context: Context, frame: Frame) -> bool:
        message = frame.message()
        handler = self._handlers.get(type(message))
        if handler is not None:
            return bool(await handler(context, message, frame))
        if self._unhandled is not None:
            return bool(await self._unhandled(context, message, frame))
        return False
