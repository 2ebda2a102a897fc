"""torchrun's flags under `fdl run`: which are accepted, which refused (with the flodld equivalent), and
the `TorchrunPlan` they amount to. Pure: reads an argparse namespace, raises ValueError (exit 2) naming
the refused flag, returns a plan; `fdl.run` carries the plan out.

The flags with nothing to set here (--rdzv-backend c10d, --start-method spawn, ...) are rows of
`TORCHRUN_NOTED`: the values accepted, the line printed, the refusal for any other value.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flodld import api

MAX_RESTARTS = 1000  # as controller.join.max_restarts


def _flag(name: str) -> list[str]:
    """Both spellings torchrun takes of a flag: --max-restarts and --max_restarts."""
    return [name, "--" + name[2:].replace("-", "_")] if "-" in name[2:] else [name]


def add_torchrun_options(parser: argparse.ArgumentParser) -> None:
    """The flags of torchrun (torch.distributed.run), checked by `torchrun_plan`."""
    group = parser.add_argument_group("torchrun's flags (see the description above)")
    for name in ("--module", "--no-python", "--run-path", "--standalone"):
        names = (["-m"] if name == "--module" else []) + _flag(name)
        dest = name[2:].replace("-", "_")
        group.add_argument(*names, dest=dest, action="store_true", help=argparse.SUPPRESS)
    for name, kind in TORCHRUN_VALUED.items():
        group.add_argument(*_flag(name), dest=name[2:].replace("-", "_"), type=kind, default=None,
                           help=argparse.SUPPRESS)  # fmt: skip


TORCHRUN_VALUED: dict[str, Callable[[str], object]] = {
    "--nnodes": str, "--max-restarts": int, "--node-rank": int, "--master-addr": str, "--master-port": int,
    "--rdzv-endpoint": str, "--rdzv-conf": str, "--rdzv-backend": str, "--rdzv-id": str,
    "--monitor-interval": float, "--start-method": str, "--local-ranks-filter": str, "--role": str,
    "--event-log-handler": str, "--local-addr": str, "--logs-specs": str, "--numa-binding": str,
    "--signals-to-handle": str, "--shutdown-timeout": str,
    "--virtual-local-rank": str, "--duplicate-stdout-filters": str, "--duplicate-stderr-filters": str,
}  # fmt: skip
"""torchrun's flags that take a value, with the type fdl run reads it as."""

TORCHRUN_REFUSED: dict[str, str] = {
    "--duplicate-stdout-filters": "rank output is not filtered yet (the operability work)",
    "--duplicate-stderr-filters": "rank output is not filtered yet (the operability work)",
    "--role": "flodld has one role; name the host with FLODL_HOST_NAME (or `fdl join --host`)",
    "--event-log-handler": "the controller's events are in state.json and its log (flodld serve --state-dir)",
    "--local-addr": "the host's name in the roster comes from FLODL_HOST_NAME (or `fdl join --host NAME`)",
    "--logs-specs": "rank output is prefixed per rank; keep it in files with --log-dir and --redirects/--tee",
    "--numa-binding": "bind ranks in PROGRAM itself (os.sched_setaffinity) or with numactl via --no-python",
    "--signals-to-handle": "fdl run aborts the run on SIGINT/SIGTERM and tears every rank down",
    "--shutdown-timeout": "ranks get SIGTERM, then SIGKILL after the agent's grace (5 s)",
    "--virtual-local-rank": "each rank sees its own device as LOCAL_RANK; set CUDA_VISIBLE_DEVICES yourself",
}
"""torchrun flags fdl run refuses, with what to use instead."""


@dataclass(frozen=True)
class Noted:
    """A torchrun flag with nothing to set under fdl run: the values it may take (None: any), the line
    printed when it is given ({value} is its value), and the refusal of any other value.
    """

    values: frozenset[str] | None
    note: str
    refusal: str = ""


TORCHRUN_NOTED: dict[str, Noted] = {
    "--rdzv-backend": Noted(
        frozenset({"c10d", "static"}),
        "--rdzv-backend {value}: the rendezvous is flodld's controller",
        "--rdzv-backend {value}: the rendezvous is flodld's controller (its authenticated store); "
        "drop the flag, or give c10d/static",
    ),
    "--rdzv-id": Noted(None, "--rdzv-id: the controller names the run (its run id), nothing to set"),
    "--start-method": Noted(
        frozenset({"spawn"}),
        "--start-method spawn: every rank is a fresh process anyway",
        "--start-method {value}: every rank is a fresh process (torchrun's spawn); drop the flag",
    ),
    "--monitor-interval": Noted(
        None, "--monitor-interval: the agent learns of a rank's exit at once, nothing to poll"
    ),
}
"""torchrun flags accepted with a line saying they have nothing to set, in the order the lines print."""

RDZV_CONF_KEYS = ("join_timeout",)
"""--rdzv-conf keys fdl run honours (the rest of torchrun's have no counterpart yet and are refused)."""


@dataclass(frozen=True)
class TorchrunPlan:
    """What torchrun's flags ask of `fdl run`: walk in to a controller, a join timeout, notes to print."""

    walk_in: tuple[str, int] | None = None  # the controller to join as a walk-in agent (fdl join HOST:PORT)
    join_timeout: float | None = None
    rank_filter: frozenset[int] | None = None  # --local-ranks-filter: the ranks whose lines are shown
    max_restarts: int | None = None  # --max-restarts: failed attempts re-formed before the run fails
    nnodes: tuple[int, int] | None = None  # --nnodes MIN:MAX over one host: the window's bounds, in hosts
    notes: tuple[str, ...] = ()


def nnodes_bounds(value: str) -> tuple[int, int]:
    """The value of torchrun's --nnodes, 'N' or 'MIN:MAX', as (MIN, MAX)."""
    try:
        low, _, high = value.partition(":")
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"--nnodes {value!r} is not understood: give N or MIN:MAX (hosts)") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--nnodes {value!r}: give 1 <= MIN <= MAX")
    return bounds


def _address(flag: str, value: str, port: int | None = None) -> tuple[str, int]:
    """The controller's address from --rdzv-endpoint or --master-addr (its port, else the default 1337)."""
    try:
        host, parsed = api.parse_address(value)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    return host, port if port is not None else parsed


class _Flags:
    """torchrun's flags in an argparse namespace, read by their command-line names."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __getitem__(self, name: str) -> Any:  # noqa: ANN401 (each flag has its own type, as TORCHRUN_VALUED says)
        return getattr(self.args, name[2:].replace("-", "_"), None)


def _check_exclusions(args: argparse.Namespace, flags: _Flags) -> None:
    """Refused flags, flags that exclude each other, and --max-restarts out of range."""
    for flag, instead in TORCHRUN_REFUSED.items():
        if flags[flag] is not None:
            raise ValueError(f"torchrun's {flag} is not supported by fdl run: {instead}")
    if args.module and args.no_python:
        raise ValueError("-m and --no-python exclude each other (as under torchrun): give one")
    if args.run_path and (args.module or args.no_python):
        raise ValueError("--run-path runs PROGRAM as a Python file: drop -m/--no-python")
    restarts = flags["--max-restarts"]
    if restarts is not None and not 0 <= restarts <= MAX_RESTARTS:
        raise ValueError(f"--max-restarts {restarts}: give a count from 0 to {MAX_RESTARTS}")


def _noted(flags: _Flags) -> list[str]:
    """The lines of the TORCHRUN_NOTED flags given; ValueError for a value they do not take."""
    notes = []
    for flag, row in TORCHRUN_NOTED.items():
        value = flags[flag]
        if value is None:
            continue
        if row.values is not None and value not in row.values:
            raise ValueError(row.refusal.format(value=value))
        notes.append(row.note.format(value=value))
    return notes


def _rank_filter(text: str | None) -> frozenset[int] | None:
    """--local-ranks-filter R[,R] as the set of ranks."""
    if text is None:
        return None
    try:
        return frozenset(int(word) for word in text.split(","))
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter {text!r}: give rank numbers separated by commas, e.g. 0,1,2"
        ) from None


def _join_timeout(conf: str | None) -> float | None:
    """--rdzv-conf join_timeout=SECONDS (the last one given wins); the other keys are refused."""
    join_timeout: float | None = None
    for pair in conf.split(",") if conf else ():
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or key not in RDZV_CONF_KEYS:
            raise ValueError(
                f"--rdzv-conf {pair!r}: fdl run takes only {', '.join(RDZV_CONF_KEYS)}=SECONDS (the join "
                "window; the other timeouts are the controller's, set in fdl.yml controller.join)"
            )
        try:
            join_timeout = float(text)
        except ValueError:
            raise ValueError(f"--rdzv-conf {pair!r}: {key} must be a number of seconds") from None
        if join_timeout <= 0:
            raise ValueError(f"--rdzv-conf {pair!r}: {key} must be positive")
    return join_timeout


def _walk_in(args: argparse.Namespace, flags: _Flags, notes: list[str]) -> tuple[str, int] | None:
    """The controller to walk in to (--rdzv-endpoint, or --master-addr with --node-rank), else None;
    appends the lines of the address flags that have nothing to set.
    """
    node_rank, master_addr, master_port = flags["--node-rank"], flags["--master-addr"], flags["--master-port"]
    endpoint = flags["--rdzv-endpoint"]
    if args.standalone:
        if endpoint or master_addr or node_rank:
            notes.append("--standalone: the embedded controller, whatever --rdzv-endpoint/--master-* say")
        return None
    if endpoint and not endpoint.endswith(":0"):
        return _address("--rdzv-endpoint", endpoint)
    if node_rank and master_addr:
        return _address("--master-addr", master_addr, master_port)
    if node_rank:
        raise ValueError(
            f"--node-rank {node_rank}: give the controller's address (--master-addr or --rdzv-endpoint)"
        )
    if master_addr or master_port:
        notes.append(
            "--master-addr/--master-port: the ranks' MASTER_ADDR:MASTER_PORT is the agent's own loopback "
            "store endpoint (a free port); fdl run's controller port is --port"
        )
    return None


def _check_walk_in(flags: _Flags, rank_filter: frozenset[int] | None, notes: list[str]) -> None:
    """What a walk-in cannot take (a rank filter, restarts); a line for --node-rank."""
    node_rank, restarts = flags["--node-rank"], flags["--max-restarts"]
    if node_rank is not None:
        notes.append(f"--node-rank {node_rank}: the controller assigns ranks (hosts in join order)")
    if rank_filter is not None:
        raise ValueError("--local-ranks-filter: only on the embedded default, not when walking in (yet)")
    if restarts:
        raise ValueError(
            f"--max-restarts {restarts}: a walk-in joins another controller's run, whose restarts are that "
            "controller's (controller.join.max_restarts); drop the flag"
        )


def torchrun_plan(args: argparse.Namespace) -> TorchrunPlan:
    """Check torchrun's flags in `args`; ValueError (exit 2) names a refused one and the flodld equivalent."""
    flags = _Flags(args)
    _check_exclusions(args, flags)
    notes = _noted(flags)
    rank_filter = _rank_filter(flags["--local-ranks-filter"])
    join_timeout = _join_timeout(flags["--rdzv-conf"])
    nnodes: str | None = flags["--nnodes"]
    _, most = nnodes_bounds(nnodes) if nnodes is not None else (1, 1)
    walk_in = _walk_in(args, flags, notes)
    if walk_in is not None:
        _check_walk_in(flags, rank_filter, notes)
    bounds = nnodes_bounds(nnodes) if walk_in is None and most > 1 and nnodes is not None else None
    return TorchrunPlan(
        walk_in=walk_in,
        join_timeout=join_timeout,
        rank_filter=rank_filter,
        nnodes=bounds,
        notes=tuple(notes),
        max_restarts=flags["--max-restarts"],
    )
