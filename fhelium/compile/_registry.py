"""Passes known by name (the command-line tool's vocabulary): the built-in list plus registered ones."""

from __future__ import annotations

from collections.abc import Mapping

from fhelium.compile._pipeline import Pass, PassError
from fhelium.compile.passes import BUILTIN_PASSES

_BY_NAME: dict[str, type[Pass]] = {each.name: each for each in BUILTIN_PASSES}


def register_pass(pass_type: type[Pass]) -> None:
    """Make a `Pass` subclass known to `create_pass` and fhelium-opt under its `name`."""
    if pass_type.name in _BY_NAME:
        raise ValueError(f"pass {pass_type.name!r} is already registered")
    _BY_NAME[pass_type.name] = pass_type


def pass_names() -> tuple[str, ...]:
    return tuple(sorted(_BY_NAME))


def create_pass(name: str, options: Mapping[str, str] | None = None) -> Pass:
    """Build a known pass by name, e.g. `create_pass("lower-specialized-collectives")`."""
    try:
        pass_type = _BY_NAME[name]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise PassError(f"unknown pass {name!r}; known passes: {known}") from None
    return pass_type.from_options(options or {})
