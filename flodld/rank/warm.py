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
from dataclasses import dataclass
from typing import Any, Final

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


def encode_handoff(argv: Sequence[str], env: Mapping[str, str], **layout: int) -> bytes:
    """The line a warm rank reads: what the launcher's argv would be after `-m flodld.launcher.rank`
    (`layout`: a fork request's descriptor counts, see `encode_fork_request`).
    """
    message = {"argv": list(argv), "env": dict(env), **layout}
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_HANDOFF_BYTES:
        raise HandoffError(f"hand-off of {len(line)} bytes is over the {MAX_HANDOFF_BYTES}-byte cap")
    return line


def decode_handoff(line: bytes) -> tuple[list[str], dict[str, str]]:
    """The (argv, env) of a hand-off line; HandoffError naming what is wrong."""
    argv, env, _ = _decode_handoff(line, layout=())
    return argv, env


def _load_json(data: bytes, cap: int, error: type[ValueError], what: str) -> Any:  # noqa: ANN401  JSON
    """`data` parsed as JSON, refused (`error`) when over `cap` bytes or not JSON."""
    if len(data) > cap:
        raise error(f"{what} over the {cap}-byte cap")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as reason:
        raise error(f"{what} is not JSON: {reason}") from None


def _decode_handoff(line: bytes, layout: tuple[str, ...]) -> tuple[list[str], dict[str, str], dict[str, int]]:
    message = _load_json(line, MAX_HANDOFF_BYTES, HandoffError, "hand-off line")
    keys = {"argv", "env", *layout}
    if not isinstance(message, dict) or set(message) != keys:
        raise HandoffError(f"hand-off line must be an object with exactly the keys {', '.join(sorted(keys))}")
    counts = {name: message[name] for name in layout}
    if not all(type(count) is int for count in counts.values()):
        raise HandoffError(f"hand-off {', '.join(layout)} must be integers")
    argv, env = message["argv"], message["env"]
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise HandoffError("hand-off argv must be a non-empty list of strings (the script, then its args)")
    if not isinstance(env, dict) or not all(
        isinstance(name, str) and isinstance(value, str) and name and "=" not in name and "\0" not in value
        for name, value in env.items()
    ):
        raise HandoffError("hand-off env must map variable names (no '=') to strings (no NUL)")
    return argv, env, counts


# The fork server (`python -m flodld.launcher.rank --fork-server`): a warm rank that never becomes a rank
# itself but forks one per request, so a host that starts ranks again and again (a `fdl join --persist`
# loop re-admitted after each fault) pays torch's import once. The requests are hand-off lines (above)
# sent over a unix SOCK_SEQPACKET socket with the rank's stdout (and stderr, when apart) as SCM_RIGHTS
# descriptors; the replies below are one JSON object per packet.

FORK_SERVER_ENV: Final = "FLODL_FORK_SERVER"
"""On an agent: the path of its host's fork server socket (set by `fdl join`). Not inherited by its
children."""

FORK_SERVER_FLAG: Final = "--fork-server"
"""`python -m flodld.launcher.rank --fork-server FD`: load torch, then fork ranks on request (FD listens)."""

MAX_REPLY_BYTES: Final = 64 << 10
MAX_REQUEST_BYTES: Final = 128 << 10
"""A fork request's cap (one packet: within a unix socket's default send buffer); a rank whose hand-off is
longer starts cold."""
FIRST_PASSED_FD: Final = 3
"""Where a forked child finds the descriptors its request passed beyond its output streams (3, 4, ...):
the relay's rank listener, whose number its spec names."""
MAX_PASSED_FDS: Final = 1
MAX_REQUEST_FDS: Final = 2 + MAX_PASSED_FDS  # stdout, stderr when apart, then the passed ones


@dataclass(frozen=True)
class ForkRequest:
    """One fork: the hand-off (argv after `-m flodld.launcher.rank`, the whole environment) and how the
    descriptors sent with it are laid out: `streams` output pipes (stdout; stderr when 2), then `passed`
    descriptors the child finds at FIRST_PASSED_FD on.
    """

    argv: list[str]
    env: dict[str, str]
    streams: int = 1
    passed: int = 0


def encode_fork_request(request: ForkRequest) -> bytes:
    return encode_handoff(request.argv, request.env, streams=request.streams, passed=request.passed)


def decode_fork_request(packet: bytes, descriptors: int) -> ForkRequest:
    """The request in one packet sent with `descriptors` descriptors; HandoffError naming what is wrong."""
    argv, env, counts = _decode_handoff(packet, layout=("passed", "streams"))
    streams, passed = counts["streams"], counts["passed"]
    if streams not in (1, 2) or not 0 <= passed <= MAX_PASSED_FDS:
        raise HandoffError(f"a fork request has 1 or 2 streams and up to {MAX_PASSED_FDS} passed descriptors")
    if descriptors != streams + passed:
        raise HandoffError(
            f"a fork request of {streams} stream(s) and {passed} passed came with {descriptors} descriptor(s)"
        )
    return ForkRequest(argv, env, streams, passed)


class ForkReplyError(ValueError):
    """A fork server reply that is not one of `Ready`, `Forked`, `Refused`, `Exited`."""


@dataclass(frozen=True)
class Ready:
    """The server's first packet on a connection: its start-up variables (see `startup_differences`)."""

    startup: dict[str, str]


@dataclass(frozen=True)
class Forked:
    """The request was served: the rank's pid (its own session, so its process group is its pid)."""

    pid: int


@dataclass(frozen=True)
class Refused:
    """The request was not served (the agent starts the rank cold), and why."""

    reason: str


@dataclass(frozen=True)
class Exited:
    """A rank this connection asked for has exited: its code as subprocess reports it (-N: signal N)."""

    pid: int
    code: int


ForkReply = Ready | Forked | Refused | Exited

_REPLY_FIELDS: Final[dict[str, tuple[type, dict[str, type]]]] = {
    "ready": (Ready, {"startup": dict}),
    "forked": (Forked, {"pid": int}),
    "refused": (Refused, {"reason": str}),
    "exited": (Exited, {"pid": int, "code": int}),
}
_REPLY_KIND: Final = {cls: kind for kind, (cls, _) in _REPLY_FIELDS.items()}


def encode_reply(reply: ForkReply) -> bytes:
    """One reply packet."""
    packet = json.dumps({"kind": _REPLY_KIND[type(reply)], **vars(reply)}, separators=(",", ":")).encode()
    if len(packet) > MAX_REPLY_BYTES:
        raise ForkReplyError(f"a fork server reply of {len(packet)} bytes is over {MAX_REPLY_BYTES}")
    return packet


def decode_reply(packet: bytes) -> ForkReply:
    """The reply in one packet; ForkReplyError naming what is wrong."""
    message = _load_json(packet, MAX_REPLY_BYTES, ForkReplyError, "fork server reply")
    kind = message.get("kind") if isinstance(message, dict) else None
    if kind not in _REPLY_FIELDS:
        raise ForkReplyError(f"fork server reply of unknown kind {kind!r}")
    cls, fields = _REPLY_FIELDS[kind]
    values = {name: message.get(name) for name in fields}
    if set(message) != {"kind", *fields} or not all(
        isinstance(values[name], of) and not isinstance(values[name], bool) for name, of in fields.items()
    ):
        raise ForkReplyError(f"fork server {kind!r} reply must have exactly the fields {sorted(fields)}")
    startup = values.get("startup")
    if isinstance(startup, dict) and not all(isinstance(v, str) for v in startup.values()):
        raise ForkReplyError("fork server 'ready' reply: startup must map names to strings")
    return cls(**values)  # type: ignore[no-any-return]  # one of the four, by the table
