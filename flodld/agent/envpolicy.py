"""Which of the controller's `env` a walk-in applies to its ranks (pure: names in, verdict out).

A fan-out agent is started over SSH by the operator's own launcher, from the operator's own
fdl.yml: the controller's `env` is the operator's, and it applies unfiltered. A walk-in (`fdl join`,
`--persist`, a golden image) dials a controller that it trusts only as far as the admission proves:

- under a pre-shared token the controller is authenticated, but it is still another party: the
  walk-in applies only names that cannot load code or name a path (`ALLOWED_NAMES`, the NCCL_/
  GLOO_ tuning knobs of `_is_safe_prefixed`) plus the names its owner accepts (`--accept-env`,
  `join.accept_env`). Any other name refuses the run on this host, naming the variables.
- under open admission nothing authenticates the controller (anyone who answers the dial can play
  it), so the walk-in applies no controller env at all, accepted names included.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

ENV_NAME_PATTERN: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Thread counts and torch knobs that change logging, checks or timeouts, never what code runs.
ALLOWED_NAMES: Final = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_DOMAIN_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
    "TORCH_GLOO_LAZY_INIT", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "FLODL_NET_TIMEOUT_SCALE", "FLODL_LIVENESS_TIMEOUT_SECS", "FLODL_HEARTBEAT_INTERVAL_SECS",
})  # fmt: skip

# NCCL_* and GLOO_* are tuning knobs, except those that load a plugin, read or write a file or a
# directory, or point the bootstrap at an address (NCCL_NET_PLUGIN, NCCL_CONF_FILE, NCCL_TOPO_FILE,
# NCCL_DEBUG_FILE, NCCL_COMM_ID, ...): a name holding any of these words is not safe.
SAFE_PREFIXES: Final = ("NCCL_", "GLOO_")
UNSAFE_WORDS: Final = ("PLUGIN", "FILE", "PATH", "DIR", "LIB", "CONF", "DUMP", "ADDR", "COMM_ID", "SCRIPT",
                       "EXEC", "CMD", "HOME", "CACHE", "MODULE", "LOAD")  # fmt: skip


def is_walk_in_safe(name: str) -> bool:
    """True when a walk-in applies `name` from an authenticated controller without being asked."""
    if name in ALLOWED_NAMES:
        return True
    if name.startswith(SAFE_PREFIXES) and ENV_NAME_PATTERN.match(name):
        return not any(word in name for word in UNSAFE_WORDS)
    return False


def parse_accept_env(values: Iterable[str]) -> tuple[str, ...]:
    """`--accept-env A,B --accept-env C` → ('A', 'B', 'C'); ValueError names a bad entry."""
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            name = part.strip()
            if not name:
                continue
            if not ENV_NAME_PATTERN.match(name) or len(name) > 256:
                raise ValueError(f"--accept-env entry {name!r} is not an environment variable name "
                                 "(letters, digits and _, not starting with a digit; no wildcards)")
            if name not in names:
                names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class EnvVerdict:
    """What to apply, what refuses the run (authenticated controller), what was dropped (open)."""

    apply: dict[str, str]
    refused: tuple[str, ...]
    dropped: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.refused


def judge_controller_env(
    env: Mapping[str, str], *, authenticated: bool, accepted: Iterable[str] = ()
) -> EnvVerdict:
    """The walk-in's verdict on the controller's `env` (fan-out agents do not call this)."""
    if not authenticated:
        return EnvVerdict({}, (), tuple(sorted(env)))
    allowed = set(accepted)
    apply = {name: value for name, value in env.items() if name in allowed or is_walk_in_safe(name)}
    refused = tuple(sorted(name for name in env if name not in apply))
    return EnvVerdict(apply, refused, ())


def refusal_message(refused: Iterable[str], where: str) -> str:
    names = sorted(refused)
    return (
        f"REFUSING the run on this host: controller {where} sets environment variable(s) {', '.join(names)} "
        "for this walk-in's ranks, outside what a walk-in applies unasked (thread counts, NCCL_*/GLOO_* "
        "tuning, torch debug knobs). A controller's env can run code on this machine (LD_PRELOAD, "
        "PYTHONSTARTUP, BASH_ENV, ...). If you trust this controller with them, pass --accept-env "
        f"{','.join(names)} to fdl join (or list them under join.accept_env in fdl.yml); otherwise ask its "
        "operator to drop them from env:"
    )


def dropped_message(dropped: Iterable[str], where: str, accepted: tuple[str, ...] = ()) -> str:
    names = sorted(dropped)
    message = (
        f"WARNING: ignoring controller {where}'s env ({', '.join(names)}): under open admission nothing "
        "authenticates the controller, so a walk-in applies none of its environment; "
        "join with the run's --token to receive it"
    )
    if accepted:
        message += " (--accept-env/join.accept_env apply only with a token)"
    return message
