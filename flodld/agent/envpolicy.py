"""Which of the controller's `env` a walk-in applies to its ranks (pure: names in, verdict out).

A fan-out agent is started over SSH by the operator's own launcher, from the operator's own
fdl.yml: the controller's `env` is the operator's, and it applies unfiltered. A walk-in (`fdl join`,
`--persist`, a golden image) dials a controller that it trusts only as far as the admission proves:

- under a pre-shared token the controller is authenticated, but it is still another party: the
  walk-in applies only the names of `ALLOWED_NAMES`, which change how hard or how verbosely the ranks
  work (thread counts, NCCL tuning, debug levels, timeouts) and never what runs, where the traffic goes
  or what is read and written: no name that loads code or a library, names a file or a directory, or
  selects a network interface, an address, a port, an address family, a transport or a host identity
  (`NCCL_SOCKET_IFNAME`, `GLOO_DEVICE_TRANSPORT`, `NCCL_IB_HCA`, `NCCL_HOSTID`, ...), plus the names
  its owner accepts (`--accept-env`, `join.accept_env`). The list is closed: a name it does not hold,
  a new NCCL or Gloo knob included, refuses the run on this host, naming the variables.
- under open admission nothing authenticates the controller (anyone who answers the dial can play
  it), so the walk-in applies no controller env at all, accepted names included.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

ENV_NAME_PATTERN: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Thread counts, torch and NCCL debug/tuning knobs and flodld timeouts: how hard, how verbosely and how
# patiently the ranks work, never what code runs, where the traffic goes or which file is touched. Every
# name is listed (no prefix rule): NCCL and Gloo also read names that select the network interface
# (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), the address family (NCCL_SOCKET_FAMILY), the transport
# (GLOO_DEVICE_TRANSPORT, NCCL_NET, NCCL_IB_DISABLE), the NIC (NCCL_IB_HCA), the host identity
# (NCCL_HOSTID), TLS key files (GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY) or a plugin, and a future knob may do
# the same, so an unknown name is refused, not guessed safe.
ALLOWED_NAMES: Final = frozenset({
    # thread counts
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_DOMAIN_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
    # torch: logging, checks, timeouts, numerics
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
    "TORCH_GLOO_LAZY_INIT", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    # NCCL: log level, algorithm and protocol choice, channel/thread counts, buffer sizes, checks
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_ALGO", "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NRINGS", "NCCL_MAX_NRINGS",
    "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_NTHREADS", "NCCL_LL128_NTHREADS",
    "NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE",
    "NCCL_LL_THRESHOLD", "NCCL_TREE_THRESHOLD", "NCCL_SINGLE_RING_THRESHOLD",
    "NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_NTHREADS",
    "NCCL_LAUNCH_MODE", "NCCL_CHECK_POINTERS", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT",
    "NCCL_IGNORE_CPU_AFFINITY", "NCCL_SET_THREAD_NAME", "NCCL_WORK_FIFO_DEPTH",
    # flodld: timeouts
    "FLODL_NET_TIMEOUT_SCALE", "FLODL_LIVENESS_TIMEOUT_SECS", "FLODL_HEARTBEAT_INTERVAL_SECS",
})  # fmt: skip

# Parts of a name that mark it as choosing a path, a peer or a transport. No allowed name holds one (a
# test keeps it so); `NCCL_SOCKET_NTHREADS`, `VECLIB_MAXIMUM_THREADS` and `FLODL_NET_TIMEOUT_SCALE` are
# thread counts and a timeout, which is why the marks are these and not a bare "SOCKET", "LIB" or "NET".
ROUTING_MARKS: Final = (
    "IFNAME", "FAMILY", "ADDR", "PORT", "HOST", "TRANSPORT", "TLS", "PKEY", "CERT", "_KEY", "_CA",
    "FILE", "PATH", "DIR", "LIBRARY", "_LIB", "PRELOAD", "PLUGIN", "CONF", "DUMP", "MODULE", "LOAD",
    "COMM_ID", "NCCL_NET", "_IB_", "HCA", "GID", "_DISABLE", "P2P", "SHM", "COLLNET", "NVLS", "CROSS_NIC",
)  # fmt: skip


def is_walk_in_safe(name: str) -> bool:
    """True when a walk-in applies `name` from an authenticated controller without being asked."""
    return name in ALLOWED_NAMES


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

    def notice(self, where: str, accepted: tuple[str, ...] = ()) -> str | None:
        """What the operator is told of controller `where`'s env: its refusal, what was dropped, or None."""
        if self.refused:
            return refusal_message(self.refused, where)
        return dropped_message(self.dropped, where, accepted) if self.dropped else None


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
        "for this walk-in's ranks, outside what a walk-in applies unasked (thread counts, listed NCCL "
        "tuning and torch debug knobs). A controller's env can run code on this machine (LD_PRELOAD, "
        "PYTHONSTARTUP, BASH_ENV, ...) or move its traffic onto another interface or transport "
        "(NCCL_SOCKET_IFNAME, GLOO_DEVICE_TRANSPORT, ...). If you trust this controller with them, pass "
        "--accept-env "
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
