"""Read loops over `wire.handlers.HandlerTable`s: the relay's and the controller data plane's channels.

Each table maps a message class to a handler typed for that class, called as
`handler(message, context, frame)`; a handler returns True to end the loop. A message whose class has no
handler goes to `unhandled` (default: ignored, as these loops always did).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from flodld.net.stream import FramedStream
from flodld.wire.frames import Frame
from flodld.wire.handlers import HandlerTable
from flodld.wire.messages import Message

Context = TypeVar("Context")
Outcome = bool | None


async def serve_frames(
    stream: FramedStream,
    table: HandlerTable[[Context, Frame], Awaitable[Outcome]],
    context: Context,
    *,
    unhandled: Callable[[Message, Context], Awaitable[Outcome]] | None = None,
) -> None:
    """Receive frames from `stream` and dispatch each through `table` until a handler returns True.

    Errors of the stream (EOFError, OSError, WireError) and of the handlers propagate to the caller.
    """
    while True:
        frame = await stream.recv()
        message = frame.message()
        if type(message) in table:
            done = await table.dispatch(message, context, frame)
        elif unhandled is not None:
            done = await unhandled(message, context)
        else:
            done = False
        if done:
            return
