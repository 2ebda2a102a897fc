"""What every worker role's spec shares: hex JSON in one environment variable, and its error.

The agent, the relay and a rank each read their spec (`flodld.agent.spec`, `flodld.relay.spec`)
from an environment variable written by the process that started them, never from argv (a spec may
carry the salt, and any local user can read a command line). This module is the one place that
encodes and decodes that form, so the roles' spec modules depend on it and not on each other.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from pydantic import BaseModel


class SpecError(ValueError):
    """A role spec in the environment is unreadable; the message names the variable and the problem."""


def encode_spec(spec: BaseModel) -> str:
    """Lowercase hex of the compact JSON, unset optionals omitted."""
    return spec.model_dump_json(exclude_none=True).encode().hex()


def decode_hex_json(text: str, variable: str) -> object:
    """The JSON value hex-encoded in `text`, read from the environment variable `variable`."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError as error:
        raise SpecError(f"{variable} is not valid hex ({error}); it must be hex-encoded JSON") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpecError(f"{variable} decodes to invalid JSON: {error}") from None


def run_role(name: str, run: Callable[[], int]) -> None:
    """Run a worker role (`python -m flodld.agent`, the relay) to its exit code and leave; an escaping error
    is printed, code 1. Interpreter teardown is skipped: torch's static destructors and lingering threads
    only cost time there.
    """
    try:
        code = run()
    except Exception as error:
        print(f"flodld {name}: {error}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
