"""The encrypted mean's command line, shared by examples/encrypted_mean.py and the programs built on it
(the flagship tests' faulty ranks): its arguments, the transport the run's averaging mode calls for,
and the one-line verdict every rank prints.
"""

from __future__ import annotations

import argparse

from flodld_fhelium.aggregation import DEFAULT_ERROR_BOUND, Outcome
from flodld_fhelium.relay import DEFAULT_SHARE_TIMEOUT_S, RelayTransport
from flodld_fhelium.transport import ProcessGroupTransport, Transport

__all__ = ["DEFAULT_VALUES", "choose_transport", "open_transport", "parse_arguments", "report"]

DEFAULT_VALUES = 1 << 20


def parse_arguments(
    argv: list[str] | None = None, *, description: str = "Encrypted mean of every rank's update."
) -> argparse.Namespace:
    """The encrypted mean's arguments (`argv`: sys.argv[1:] when None); exits 2 naming a bad one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--values", type=int, default=DEFAULT_VALUES, help="values per update (default 1048576)"
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "relay", "process-group"),
        default="auto",
        help="auto: relays under a cpu_* averaging mode, else the process group",
    )
    parser.add_argument(
        "--keys",
        choices=("threshold", "single"),
        default="threshold",
        help="threshold: no key holder, every rank decrypts with its share (default); "
        "single: rank 0 holds the secret key",
    )
    parser.add_argument(
        "--threshold",
        type=int,
        default=None,
        metavar="T",
        help="threshold keys: t-out-of-N (any T ranks decrypt; up to N-T may leave mid-round) instead of "
        "N-out-of-N",
    )
    parser.add_argument(
        "--share-timeout",
        type=float,
        default=DEFAULT_SHARE_TIMEOUT_S,
        help="threshold: seconds to wait for every rank's key or decryption share before failing",
    )
    parser.add_argument(
        "--lower", action="store_true", help="run the lowered (generic all_reduce) Program form"
    )
    parser.add_argument(
        "--bound", type=float, default=DEFAULT_ERROR_BOUND, help="largest accepted absolute error"
    )
    parser.add_argument("--seed", type=int, default=2026, help="seed of the synthetic updates")
    args = parser.parse_args(argv)
    if args.values < 1:
        parser.error(f"--values must be at least 1, got {args.values}")
    if args.threshold is not None and (args.threshold < 1 or args.keys != "threshold"):
        parser.error(f"--threshold needs --keys threshold and a value of at least 1, got {args.threshold}")
    return args


def choose_transport(requested: str) -> str:
    """`auto`: the relays under a cpu_* averaging mode with a relay on this host, else the process group."""
    if requested != "auto":
        return requested
    from flodld.rank.env import in_flodld_rank, read_rank_environment

    if in_flodld_rank():
        env = read_rank_environment()
        if env.averaging.startswith("cpu_") and env.relay_port is not None:
            return "relay"
    return "process-group"


def open_transport(name: str) -> Transport:
    """The named transport; a process group is initialised here (flodld rank, torchrun or a world of one)."""
    if name == "relay":
        return RelayTransport()
    import fhelium.distributed as fdist
    from flodld.rank import in_flodld_rank, init_process_group

    if in_flodld_rank():
        init_process_group()
    else:
        fdist.init()  # torchrun-style variables, or a world of one
    return ProcessGroupTransport()


def report(outcome: Outcome, transport: str, keys: str = "single") -> str:
    """The verdict line: PASS/FAIL, the measured error against the bound, and each phase's time."""
    phases = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in outcome.timings.phases.items())
    how = "checked here" if outcome.checked_locally else "as measured by the key holder"
    verdict = "PASS" if outcome.ok else "FAIL"
    return (
        f"encrypted mean {verdict}: max error {outcome.max_error:.3e} (bound {outcome.bound:.0e}, {how}) "
        f"over {outcome.values} values, {outcome.world_size} ranks, transport {transport} keys {keys} "
        f"[{phases}]"
    )
