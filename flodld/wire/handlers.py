"""Message dispatch tables: one entry per message class, each handler typed for its own class.

A channel's loop decodes a frame into some `Message` and must reach the code for that kind. An
`isinstance` chain grows with every message, and a `dict[type[Message], Callable[[Message], ...]]`
loses the type, so every handler starts with `assert isinstance(...)`. `HandlerTable` is the
typed form (after asyncssh's packet-handler tables): `register(StoreSet, handler)` checks that
`handler` takes a `StoreSet` first, and `dispatch(message, *args)` calls the one registered for
`type(message)` with the table's extra arguments. Sans-io: the table calls what it is given, sync
or async (then `dispatch` returns the awaitable).

    apply: HandlerTable[[bytes], Reply] = HandlerTable("store mutation")
    apply.register(StoreSet, self._set)              # def _set(self, request: StoreSet, tail: bytes) -> Reply

    @REPORTS.handles(RankExited)                     # module-level functions: the decorator form
    def _rank_exited(message: RankExited, run: JoinRun, link: HostLink) -> None: ...

The key may be any class: a sans-io core keys its events the same way (`agent/supervision.py`, one table
per state). Lookup is by exact class (messages and events are final classes): a subclass is not served by
its base's handler. A message with no handler raises `Unhandled` (a `ValueError`); `handler_for` and
`in` let a loop treat it otherwise (ignore it, answer an error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Concatenate, Generic, ParamSpec, TypeVar

__all__ = ["HandlerTable", "Unhandled"]

M = TypeVar("M")
P = ParamSpec("P")
R = TypeVar("R")


class Unhandled(ValueError):
    """`dispatch` met a message class the table has no handler for."""

    def __init__(self, table: str, kind: type) -> None:
        super().__init__(f"{kind.__name__} is not a {table}")
        self.kind = kind


class HandlerTable(Generic[P, R]):
    """Class -> handler `(message, *P) -> R`; each entry keeps its own message type."""

    def __init__(self, name: str) -> None:
        self.name = name
        # The one place the per-entry message type is erased: `register` checked it, `dispatch` keys by it.
        self._handlers: dict[type, Callable[..., R]] = {}

    def register(self, kind: type[M], handler: Callable[Concatenate[M, P], R]) -> None:
        """Serve `kind` with `handler`; a class is registered once per table."""
        if kind in self._handlers:
            raise ValueError(f"{self.name}: {kind.__name__} already has a handler")
        self._handlers[kind] = handler

    def handles(
        self, kind: type[M]
    ) -> Callable[[Callable[Concatenate[M, P], R]], Callable[Concatenate[M, P], R]]:
        """Decorator form of `register`, for module-level functions; returns the function unchanged."""

        def add(handler: Callable[Concatenate[M, P], R]) -> Callable[Concatenate[M, P], R]:
            self.register(kind, handler)
            return handler

        return add

    def handler_for(self, message: object) -> Callable[..., R] | None:
        """The handler registered for `type(message)`, or None."""
        return self._handlers.get(type(message))

    def dispatch(self, message: M, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the handler of `type(message)` with `message` and the table's extra arguments."""
        handler = self._handlers.get(type(message))
        if handler is None:
            raise Unhandled(self.name, type(message))
        return handler(message, *args, **kwargs)

    def __contains__(self, kind: object) -> bool:
        return kind in self._handlers

    def __iter__(self) -> Iterator[type]:
        return iter(self._handlers)

    def __len__(self) -> int:
        return len(self._handlers)

    def __repr__(self) -> str:
        kinds = ", ".join(kind.__name__ for kind in self._handlers)
        return f"HandlerTable({self.name!r}: {kinds})"
