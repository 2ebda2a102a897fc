"""`flodld serve`: the controller as a process — config, signals, systemd readiness, exit code.

By default the daemon is a service (`Service`): it keeps its port for its whole life and hosts one run
after another. SIGTERM/SIGINT abort the current run (Abort down every link) and exit 0; SIGHUP re-reads
the config for the next window. Exit code 2: bad configuration or flags at start (systemd:
RestartPreventExitStatus=2).

`--once` hosts exactly one run. Exit codes: 0 the run is done; 1 it failed (the reason is logged and
printed); 2 bad configuration or flags; 128+N when signal N aborted it (the run is aborted cleanly first).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from flodld.config.errors import ConfigError, RuleViolations
from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.config.loader import load_config_file
from flodld.controller.historyfile import HistoryFile, StateDirError, state_dir_from
from flodld.controller.logsetup import configure_logging, flush_logging
from flodld.controller.notify import SystemdNotifier
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.controller.service import Service
from flodld.membership.policy import PolicyError, is_loopback_literal

log = logging.getLogger("flodld.controller")

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="cluster config file (fdl.yml with a cluster: block)")
    parser.add_argument("--env", help="overlay <name>.<ENV>.yml next to --config <name>.yml")
    parser.add_argument(
        "--host", help="address workers dial (default: config controller.host, else 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, help="controller port (default: config, else 1337; 0 = any free)")
    parser.add_argument(
        "--bind",
        help="listen address (default 0.0.0.0, loopback when every worker is tunneled); "
        "trust follows the address actually bound",
    )
    parser.add_argument("--ranks", type=int, help="expected ranks (capacity) when running without --config")
    parser.add_argument("--min-ranks", type=int, help="quorum (controller.join.min_rank_start)")
    parser.add_argument("--target", type=int, help="close the window at this many ranks")
    parser.add_argument("--window", type=float, help="join window seconds (join_timeout)")
    parser.add_argument("--cap", type=float, help="hard cap seconds (max_join_timeout)")
    parser.add_argument("--start", choices=["auto", "manual", "hybrid"], help="who closes the window")
    parser.add_argument(
        "--token",
        help="pre-shared session salt (join token), 32 hex characters; `fdl start` "
        "takes the start credential derived from it, never this",
    )
    parser.add_argument(
        "--open-admission", action="store_true", default=None, help="hand the salt out on join"
    )
    parser.add_argument("--discovery", action="store_true", default=None, help="roster-free window")
    parser.add_argument(
        "--tunnel-only",
        action="store_true",
        default=None,
        help="bind loopback only (refused with a non-loopback --bind)",
    )
    parser.add_argument("--averaging", choices=[mode.value for mode in AveragingMode], help="averaging mode")
    parser.add_argument("--run-id", help="run identity (default: random)")
    parser.add_argument("--tolerance", type=int, help="rank failures the run survives (default 0)")
    parser.add_argument(
        "--elastic-max-ranks",
        type=int,
        help="CPU averaging: admit walk-ins during training while the live ranks stay at or below N; they "
        "receive the last averaged state before their first round (controller.join.elastic_max_ranks)",
    )
    parser.add_argument(
        "--straggler-timeout",
        type=float,
        help="cpu_cadence/cpu_async: seconds after a round's first deposit before it closes without the "
        "ranks still owing theirs (default: wait)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        help="a failed run is re-formed at once as a fresh world up to N times, its ranks seeing "
        "TORCHELASTIC_RESTART_COUNT (controller.join.max_restarts; default 0)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="host exactly one run; the exit code is its verdict "
        "(default: a service hosting run after run until SIGTERM)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="directory that keeps the run history across restarts (history.jsonl; created 0700); "
        "default: $STATE_DIRECTORY (systemd's StateDirectory=), else the history is kept in memory only; "
        "not used with --once",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


_JOIN_FLAGS = {
    "min_ranks": "min_rank_start",
    "target": "target_ranks",
    "window": "join_timeout",
    "cap": "max_join_timeout",
    "start": "start",
    "token": "token",
    "open_admission": "open_admission",
    "discovery": "discovery",
    "tunnel_only": "tunnel_only",
    "max_restarts": "max_restarts",
    "elastic_max_ranks": "elastic_max_ranks",
}
# Flags that override a top-level controller option (flag -> option).
_OPTION_FLAGS = {
    "host": "advertised_host",
    "port": "port",
    "bind": "bind_host",
    "ranks": "capacity",
    "averaging": "averaging",
    "run_id": "run_id",
    "tolerance": "tolerance",
    "straggler_timeout": "straggler_timeout",
}


def _given(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, object]:
    """The options named by `flags` whose flag was given on the command line."""
    return {knob: getattr(args, flag) for flag, knob in flags.items() if getattr(args, flag) is not None}


def options_from_args(args: argparse.Namespace) -> ControllerOptions:
    """Config file first, flags on top. ConfigError/ValidationError/PolicyError on bad input."""
    join_values: dict[str, object] = {}
    base: ControllerOptions | None = None
    if args.config is not None:
        cluster = load_config_file(args.config, args.env).cluster
        if cluster is None:
            raise ValueError(f"{args.config} has no cluster: block; add one (see docs/controller.md)")
        base = ControllerOptions.from_cluster(cluster)
        join_values = base.join.model_dump(exclude_unset=True)
    join_values.update(_given(args, _JOIN_FLAGS))
    values = base.model_dump() if base is not None else {}
    values.update(_given(args, _OPTION_FLAGS), join=JoinConfig.model_validate(join_values))
    return ControllerOptions.model_validate(values)


async def serve(
    options: ControllerOptions,
    notifier: SystemdNotifier | None = None,
    *,
    once: bool = True,
    load: Callable[[], ControllerOptions] | None = None,
    config_path: str | None = None,
    history_file: HistoryFile | None = None,
) -> int:
    """Host runs (one with `once`) until a signal stops the service; returns the exit code."""
    notifier = notifier or SystemdNotifier()
    service = Service(
        options,
        load=load,
        config_path=config_path,
        once=once,
        history_file=history_file,
        on_phase=lambda phase, reason: notifier.status(f"{phase.value}: {reason}"[:200]),
    )
    host, port = await service.listen()
    notifier.ready(f"listening on {host}:{port}" + (" (one run)" if once else " (service)"))
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if received:
            return
        received.append(signum)
        name = signal.Signals(signum).name
        log.warning("event=signal signal=%s action=abort_run", name)
        notifier.stopping(f"{name}: aborting the run")
        service.stop(f"controller received {name}; run aborted")

    def on_reload() -> None:
        log.info("event=signal signal=SIGHUP action=reload config=%s", config_path)
        notifier.reloading()
        service.reload()
        notifier.ready(
            "config reloaded" if service.config_error is None else "reload failed; previous config kept"
        )

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    if not once:
        loop.add_signal_handler(signal.SIGHUP, on_reload)
    try:
        result = await service.serve()
        if result is not None:
            notifier.stopping(f"{result.verdict.value}: {result.reason}"[:200])
    finally:
        await service.close()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
    flush_logging()  # the run's last log lines before the verdict line
    if not once:
        log.info(
            "event=stopped runs=%d done=%d failed=%d",
            service.runs_started,
            service.runs["done"],
            service.runs["failed"],
        )
        flush_logging()
        return EXIT_DONE  # a clean stop: `systemctl stop` must not leave the unit failed
    assert result is not None
    if received:
        print(f"flodld: {result.reason}", file=sys.stderr)
        return 128 + received[0]
    if not result.ok:
        print(f"flodld: run failed: {result.reason}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_DONE


NO_WINDOW_SIZE = (
    "nothing sizes the join window: without --config there is no roster to count ranks from; pass "
    "--ranks N (the ranks to wait for), --config FILE (a cluster: block), or --discovery --min-ranks N"
)


def unjoinable_warning(options: ControllerOptions) -> str | None:
    """Why nobody could join the windows these options open, with the fix; None when someone can.

    On a network bind without a token the controller admits only peers holding its generated salt, and
    `flodld serve` has no launcher that hands it out: every walk-in would be refused `bad_key`.
    """
    join = options.join
    if join.token is not None or join.open_admission or options.preshared:
        return None
    bind = options.effective_bind_host
    if is_loopback_literal(bind):
        return None  # reachability through sshd is the credential; the salt rides the accept reply
    return (
        f"no join token on the network bind {bind}: walk-ins cannot know this run's generated salt, so "
        "nobody can join its window; pass --token HEX (controller.join.token; 32 hex characters, e.g. "
        "from `openssl rand -hex 16`) and give `fdl join` the same --token, or --bind 127.0.0.1 and "
        "tunnel the workers through sshd (--open-admission only on a fully trusted segment)"
    )


def run_serve(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    if args.config is None and args.ranks is None and not args.discovery and args.min_ranks is None:
        print(f"flodld: {NO_WINDOW_SIZE}", file=sys.stderr)
        return EXIT_USAGE
    try:
        options = options_from_args(args)
        Controller(options)  # validate the policy before touching the event loop
    except (ConfigError, RuleViolations, ValidationError, PolicyError, ValueError, OSError) as error:
        print(f"flodld: {error}", file=sys.stderr)
        return EXIT_USAGE
    warning = unjoinable_warning(options)
    if warning is not None:
        log.warning("event=unjoinable_window %s", warning)
    history_file: HistoryFile | None = None
    state_dir = None if args.once else state_dir_from(args.state_dir, os.environ)
    if state_dir is not None:
        history_file = HistoryFile(state_dir)
        try:
            history_file.open()
        except StateDirError as error:
            print(f"flodld: {error}", file=sys.stderr)
            return EXIT_USAGE
    try:
        import uvloop  # optional: a dependency on Linux only
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        config_path = str(args.config) if args.config is not None else None
        return runner(
            serve(
                options,
                once=args.once,
                load=lambda: options_from_args(args),
                config_path=config_path,
                history_file=history_file,
            )
        )
    except (OSError, PolicyError) as error:  # PolicyError: the real bind contradicts the flags (tunnel_only)
        flush_logging()
        print(f"flodld: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if history_file is not None:
            history_file.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flodld", description="The flodld controller daemon.")
    subparsers = parser.add_subparsers(dest="command")
    serve_parser = subparsers.add_parser("serve", help="run the controller (the default command)")
    add_serve_arguments(serve_parser)
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0].startswith("-"):
        words.insert(0, "serve")
    args = parser.parse_args(words)
    return run_serve(args)
