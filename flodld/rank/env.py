"""The rank's environment: the torchrun-like variables plus where the controller and relay are.

The agent writes these (flodld.agent.spawn.rank_environment) and the rank reads them back here;
both sides use the names below so they cannot drift. The salt travels in an environment variable,
never in argv, since any local user can read a command line; and the rank takes it out of its own
environment as soon as it starts (`claim_salt`, from `flodld.run`/`exit_if_worker_role`) or first
reads it, so the training program's own subprocesses (data loaders, shell-outs, tools) never inherit
the run's master key. From then on it lives only in this module.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

RANK: Final = "RANK"
WORLD_SIZE: Final = "WORLD_SIZE"
LOCAL_RANK: Final = "LOCAL_RANK"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
CONTROLLER: Final = "FLODL_CONTROLLER"
RUN_ID: Final = "FLODL_RUN_ID"
SALT: Final = "FLODL_INTERNAL_SALT"
DEVICE: Final = "FLODL_DEVICE"
BACKEND: Final = "FLODL_BACKEND"
AVERAGING: Final = "FLODL_AVERAGING"
RELAY_PORT: Final = "FLODL_RELAY_PORT"
FOLD: Final = "FLODL_FOLD"
CADENCE: Final = "FLODL_CADENCE"
HOST_NAME: Final = "FLODL_HOST_NAME"
LIVENESS_TIMEOUT: Final = "FLODL_LIVENESS_TIMEOUT_SECS"
HEARTBEAT_INTERVAL: Final = "FLODL_HEARTBEAT_INTERVAL_SECS"
WALK_IN: Final = "FLODL_WALK_IN"
"""Set to 1 for a rank that walked into a training run (docs/elastic-averaging.md, "Growth and healing"):
its first deposit waits for the averaged state its relay hands over."""

DEFAULT_LIVENESS_TIMEOUT_SECS: Final = 30.0
DEFAULT_HEARTBEAT_INTERVAL_SECS: Final = 1.0

STACK_DUMP_SIGNAL: Final = signal.SIGUSR1
"""A rank started by `python -m flodld.launcher.rank` dumps every thread's Python stack to its stderr on this
signal (`faulthandler.register`): the agent sends it, then CONT, to a rank the controller declared dead, so
a hung or stopped rank's log says where it was (docs/elastic-averaging.md)."""


def register_stack_dump() -> None:
    """Dump every thread's stack to stderr on STACK_DUMP_SIGNAL, from faulthandler's C handler, so a rank
    stuck in a C call or stopped (then continued) still answers. Not chained: the signal's default action
    would end the rank; a program that installs its own handler for it replaces this one.
    """
    import faulthandler
    import sys

    if sys.stderr is not None:
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)


# The salt once claimed from os.environ (hex, as the agent wrote it); None until then.
_claimed_salt_hex: str | None = None


def claim_salt() -> None:
    """Move the session salt out of this process's environment into this module (idempotent).

    `os.environ.pop` also unsets it in the C environment, so neither `subprocess` nor `os.system`
    nor an exec'd child sees it. A later `read_rank_environment()` still finds it.
    """
    global _claimed_salt_hex
    value = os.environ.pop(SALT, None)
    if value is not None:
        _claimed_salt_hex = value


class RankEnvError(RuntimeError):
    """The rank environment is incomplete or malformed; the message names the variable."""


@dataclass(frozen=True)
class RankEnvironment:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    controller_host: str
    controller_port: int
    run_id: str
    salt: bytes
    device: str
    backend: str
    averaging: str
    relay_port: int | None
    fold: str
    cadence: int
    host: str
    liveness_timeout: float
    heartbeat_interval: float
    walk_in: bool = False


def in_flodld_rank(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process was started as a rank by a flodld agent."""
    env = os.environ if environ is None else environ
    return CONTROLLER in env and RANK in env


_N = TypeVar("_N", int, float)


def _parsed(env: Mapping[str, str], name: str, parse: Callable[[str], _N], kind: str) -> _N | None:
    """`name`'s value read by `parse`, None when unset; RankEnvError naming `kind` when it does not parse."""
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError:
        raise RankEnvError(f"{name}={raw!r} is not {kind}") from None


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    value = _parsed(env, name, int, "an integer")
    if value is None:
        raise RankEnvError(f"{name} is not set; a flodld rank is started by its agent, which sets it")
    if value < minimum:
        raise RankEnvError(f"{name}={value} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    """Seconds, positive; `default` when unset or empty."""
    if not env.get(name):
        return default
    value = _parsed(env, name, float, "a number of seconds")
    if value is None or not value > 0:
        raise RankEnvError(f"{name}={env[name]!r} must be a positive number of seconds")
    return value


def split_host_port(text: str, what: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port), with an error naming `what` on bad input."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RankEnvError(f"{what}={text!r} is not HOST:PORT (port 1..65535)")
    return host, int(port_text)


def read_rank_environment(environ: Mapping[str, str] | None = None) -> RankEnvironment:
    """The rank's environment: `environ` as given, or this process's (whose salt it claims)."""
    if environ is None:
        claim_salt()
        env: Mapping[str, str] = {**os.environ, SALT: _claimed_salt_hex} if _claimed_salt_hex else os.environ
    else:
        env = environ
    rank = _int(env, RANK)
    world_size = _int(env, WORLD_SIZE, minimum=1)
    if rank >= world_size:
        raise RankEnvError(f"{RANK}={rank} does not fit {WORLD_SIZE}={world_size}")
    host, port = split_host_port(env.get(CONTROLLER, ""), CONTROLLER)
    salt_hex = env.get(SALT, "")
    try:
        salt = bytes.fromhex(salt_hex)
    except ValueError:
        raise RankEnvError(f"{SALT} is not hex; the agent passes the session salt there") from None
    if len(salt) != 16:
        raise RankEnvError(f"{SALT} must hold 32 hex characters (the session salt), got {len(salt_hex)}")
    relay_port = env.get(RELAY_PORT)
    return RankEnvironment(
        rank=rank,
        world_size=world_size,
        local_rank=_int(env, LOCAL_RANK),
        local_world_size=_int(env, LOCAL_WORLD_SIZE, minimum=1),
        controller_host=host,
        controller_port=port,
        run_id=env.get(RUN_ID, ""),
        salt=salt,
        device=env.get(DEVICE, "cpu"),
        backend=env.get(BACKEND, ""),
        averaging=env.get(AVERAGING, "cpu_sync"),
        relay_port=int(relay_port) if relay_port else None,
        fold=env.get(FOLD, "mean"),
        cadence=_int(env, CADENCE, minimum=1) if env.get(CADENCE) else 1,
        host=env.get(HOST_NAME, ""),
        liveness_timeout=_float(env, LIVENESS_TIMEOUT, DEFAULT_LIVENESS_TIMEOUT_SECS),
        heartbeat_interval=_float(env, HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_INTERVAL_SECS),
        walk_in=env.get(WALK_IN) == "1",
    )
