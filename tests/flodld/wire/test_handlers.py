"""HandlerTable: message class -> handler, each handler typed for its own class (flodld.wire.handlers)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from flodld.wire.handlers import HandlerTable, Unhandled
from flodld.wire.join import RankExited
from flodld.wire.store import StoreAdd, StoreGet, StoreSet


def test_dispatch_calls_the_handler_of_the_message_class_with_the_table_arguments() -> None:
    seen: list[tuple[str, object, bytes]] = []
    table: HandlerTable[[bytes], str] = HandlerTable("store mutation")

    def on_set(message: StoreSet, tail: bytes) -> str:
        seen.append(("set", message.key, tail))
        return "ok"

    def on_add(message: StoreAdd, tail: bytes) -> str:
        seen.append(("add", message.amount, tail))
        return "int"

    table.register(StoreSet, on_set)
    table.register(StoreAdd, on_add)
    assert table.dispatch(StoreSet(key="k"), b"v") == "ok"
    assert table.dispatch(StoreAdd(key="n", amount=3), b"") == "int"
    assert seen == [("set", "k", b"v"), ("add", 3, b"")]
    assert StoreSet in table and StoreGet not in table and len(table) == 2
    assert set(table) == {StoreSet, StoreAdd}
    assert (
        table.handler_for(StoreSet(key="k")) is on_set
        and table.handler_for(StoreGet(key="k", timeout=1)) is None
    )


def test_a_message_without_a_handler_raises_unhandled_naming_it() -> None:
    table: HandlerTable[[], None] = HandlerTable("store request")
    with pytest.raises(Unhandled, match=r"^StoreGet is not a store request$") as caught:
        table.dispatch(StoreGet(key="k", timeout=1))
    assert caught.value.kind is StoreGet and isinstance(caught.value, ValueError)


def test_a_class_is_registered_once_and_the_decorator_returns_the_function() -> None:
    table: HandlerTable[[list[int]], None] = HandlerTable("join-link report")

    @table.handles(RankExited)
    def exited(message: RankExited, codes: list[int]) -> None:
        codes.append(message.code)

    codes: list[int] = []
    table.dispatch(RankExited(rank=0, code=3), codes)
    assert codes == [3] and exited.__name__ == "exited"
    with pytest.raises(ValueError, match="RankExited already has a handler"):
        table.register(RankExited, exited)


def test_async_handlers_return_their_awaitable() -> None:
    table: HandlerTable[[], Awaitable[str]] = HandlerTable("query")

    async def get(message: StoreGet) -> str:
        return message.key

    table.register(StoreGet, get)

    async def main() -> str:
        return await table.dispatch(StoreGet(key="x", timeout=0))

    assert asyncio.run(main()) == "x"


def test_any_class_keys_a_table_not_only_messages() -> None:
    class Tick:
        pass

    class Tock(Tick):
        pass

    table: HandlerTable[[], str] = HandlerTable("clock event")
    table.register(Tick, lambda event: "tick")
    assert table.dispatch(Tick()) == "tick"
    assert Tock not in table  # exact class: a subclass is not served by its base's handler
    with pytest.raises(Unhandled, match="Tock is not a clock event"):
        table.dispatch(Tock())
