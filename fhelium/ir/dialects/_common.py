"""Shared building blocks for the fhelium dialects: types that carry an open state dictionary.

A value type such as `!fhelium_ckks.ciphertext<{depth = 0 : i64, basis = "Q"}>` records what the
compiler knows about the value (depth, basis, prime ids, ...). The dictionary is open on purpose:
passes may add keys, and verification only checks the keys a dialect gives meaning to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntAttr, IntegerAttr, StringAttr
from xdsl.ir import Attribute, ParametrizedAttribute, TypeAttribute
from xdsl.parser import AttrParser
from xdsl.printer import Printer


# A dataclass so subclasses inherit `state` as a field (equality and hashing compare it).
@dataclass(frozen=True, init=False)
class OpenStateType(ParametrizedAttribute, TypeAttribute):
    """A type whose only parameter is a (possibly empty) state dictionary.

    Textual form: `!dialect.name` when the state is empty, `!dialect.name<{key = value}>` otherwise,
    so the bare spelling and the spelled-out one both round-trip.
    """

    state: DictionaryAttr

    def __init__(self, state: Mapping[str, Attribute] | DictionaryAttr | None = None) -> None:
        if state is None:
            state = DictionaryAttr({})
        elif not isinstance(state, DictionaryAttr):
            state = DictionaryAttr(dict(state))
        super().__init__(state)

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        if parser.parse_optional_punctuation("<") is None:
            return (DictionaryAttr({}),)
        entries = parser.parse_optional_dictionary_attr_dict()
        parser.parse_punctuation(">")
        return (DictionaryAttr(entries),)

    def print_parameters(self, printer: Printer) -> None:
        if not self.state.data:
            return
        with printer.in_angle_brackets():
            printer.print_attr_dict(self.state.data)

    def state_value(self, key: str) -> Attribute | None:
        """The raw attribute stored under `key`, or None."""
        return self.state.data.get(key)

    def state_int(self, key: str) -> int | None:
        """An integer state entry (`depth = 0 : i64`), or None when absent."""
        value = self.state.data.get(key)
        if value is None:
            return None
        if isinstance(value, IntegerAttr):
            return int(value.value.data)
        if isinstance(value, IntAttr):
            return int(value.data)
        raise ValueError(f"{self.name} state entry {key!r} must be an integer attribute, got {value}")

    def state_str(self, key: str) -> str | None:
        """A string state entry (`basis = "Q"`), or None when absent."""
        value = self.state.data.get(key)
        if value is None:
            return None
        if isinstance(value, StringAttr):
            return value.data
        raise ValueError(f"{self.name} state entry {key!r} must be a string attribute, got {value}")

    def state_ints(self, key: str) -> tuple[int, ...] | None:
        """An integer-list state entry (`prime_ids = [0, 1]`), or None when absent."""
        value = self.state.data.get(key)
        if value is None:
            return None
        if isinstance(value, ArrayAttr):
            out: list[int] = []
            for item in value.data:
                if isinstance(item, IntegerAttr):
                    out.append(int(item.value.data))
                elif isinstance(item, IntAttr):
                    out.append(item.data)
                else:
                    raise ValueError(f"{self.name} state entry {key!r} must list integers, got {item}")
            return tuple(out)
        raise ValueError(f"{self.name} state entry {key!r} must be an array of integers, got {value}")
