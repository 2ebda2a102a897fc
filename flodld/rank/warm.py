"""Warm ranks: a rank process that loads torch before its world exists, then becomes the rank.

Starting a rank costs an interpreter and `import torch` (one to several seconds), which is most of a
restart. An agent asked for warm ranks (`WARM_ENV` in its environment, set by `fdl run`) starts them
as `python -m flodld.launcher.rank --warm` as soon as it starts itself, so the imports overlap its join
and the world's formation (and, for `fdl run --max-restarts`, the agent starts the next attempt's while
an attempt trains, so a restart that keeps its link finds them ready). When the world forms, the agent
hands each one its command line and environment as one line on its stdin (`encode_handoff`): the salt
rides the pipe, never argv. The warm process replaces its
environment with the one handed over and runs the script exactly as a cold `python -m
flodld.launcher.rank SCRIPT.py ARGS` would.

Variables read while the interpreter and torch start (`startup_variables`: PYTHON*, LD_*, the OpenMP and
BLAS thread settings, TORCH_*, allocator settings) cannot change after the import, so a warm rank whose
start-up environment differs from the rank's in any of them is not used: the agent stops it and starts
the rank cold (`startup_differences`, logged). Nothing here reads a clock or does I/O: the codec is pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Final

WARM_ENV: Final = "FLODL_AGENT_WARM_RANKS"
"""On an agent: how many warm ranks to start before its spec is known (a decimal count, at most
`MAX_WARM_RANKS`). Not inherited by the agent's children."""

WARM_FLAG: Final = "--warm"
"""`python -m flodld.launcher.rank --warm`: load torch, then wait for the hand-off on stdin."""

MAX_WARM_RANKS: Final = 64
MAX_HANDOFF_BYTES: Final = 1 << 20
"""The hand-off line's cap (argv and environment together); a longer one is refused before parsing."""

STARTUP_PREFIXES: Final = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "TORCH_",
    "PYTORCH_",
)


class HandoffError(ValueError):
    """A hand-off line that is not one JSON object {"argv": [str, ...], "env": {str: str}}."""


def warm_count(environ: Mapping[str, str]) -> int:
    """The number of warm ranks an agent is asked for (0 when `WARM_ENV` is absent)."""
    text = environ.get(WARM_ENV)
    if text is None:
        return 0
    if not text.isdigit() or not 0 <= int(text) <= MAX_WARM_RANKS:
        raise ValueError(f"{WARM_ENV}={text!r}: expected a count from 0 to {MAX_WARM_RANKS}")
    return int(text)


def startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that only take effect when a process (and torch) starts."""
    return {name: value for name, value in env.items() if name.startswith(STARTUP_PREFIXES)}


def startup_differences(warm_env: Mapping[str, str], rank_env: Mapping[str, str]) -> list[str]:
    """The start-up variables whose values differ between a warm rank and the rank it would become."""
    warm, rank = startup_variables(warm_env), startup_variables(rank_env)
    return sorted(name for name in warm.keys() | rank.keys() if warm.get(name) != rank.get(name))


def encode_handoff(argv: Sequence[str], env: Mapping[str, str]) -> bytes:
    """The line a warm rank reads: what the launcher's argv would be after `-m flodld.launcher.rank`."""
    line = json.dumps({"argv": list(argv), "env": dict(env)}, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_HANDOFF_BYTES:
        raise HandoffError(f"hand-off of {len(line)} bytes is over the {MAX_HANDOFF_BYTES}-byte cap")
    return line


def decode_handoff(line: bytes) -> tuple[list[str], dict[str, str]]:
    """The (argv, env) of a hand-off line; HandoffError naming what is wrong."""
    if len(line) > MAX_HANDOFF_BYTES:
        raise HandoffError(f"hand-off line over the {MAX_HANDOFF_BYTES}-byte cap")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HandoffError(f"hand-off line is not JSON: {error}") from None
    if not isinstance(message, dict) or set(message) != {"argv", "env"}:
        raise HandoffError("hand-off line must be an object with exactly the keys argv and env")
    argv, env = message["argv"], message["env"]
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise HandoffError("hand-off argv must be a non-empty list of strings (the script, then its args)")
    if not isinstance(env, dict) or not all(
        isinstance(name, str) and isinstance(value, str) and name and "=" not in name and "\0" not in value
        for name, value in env.items()
    ):
        raise HandoffError("hand-off env must map variable names (no '=') to strings (no NUL)")
    return argv, env
