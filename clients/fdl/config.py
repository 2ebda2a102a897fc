"""`fdl config check [FILE] [--env X]`: load a configuration the way the commands would, report every problem.

Without FILE it checks the project's fdl.yml (with the fdl.<X>.yml overlay under --env / @X / FDL_ENV, as
`fdl run` reads it). With FILE it checks that file and its overlay next to it under the same name
(`other.yml` + `--env x` -> `other.x.yml`, as `flodld serve --config other.yml --env x` reads it);
`-` reads the text from stdin.

Problems print one a line as `file:line:column: key.path: what is wrong and what is allowed`, followed by the
window rules that relate the join knobs to each other and to the roster (the controller checks those when it
starts); exit 2 on any. A clean file exits 0 with one summary line: the roster and the window.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fdl.cli import Command
from flodld import api

EXIT_OK, EXIT_PROBLEMS = 0, 2


def configure_parser(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="validate fdl.yml (or FILE) and its overlay; exit 2 on any problem",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "file", nargs="?", help="the file to check (default: fdl.yml in --project); '-' reads stdin"
    )
    check.add_argument(
        "--project", default=".", help="directory holding fdl.yml when FILE is not given (default: .)"
    )
    # The overlay of a named FILE lives next to it: `fdl` must not look for it in the project directory.
    check.set_defaults(func=main, env_checked_by_command=True)


def _problem(text: str) -> None:
    print(text, file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    env = getattr(args, "env", None)
    files: list[Path]
    try:
        if args.file == "-":
            if env is not None:
                _problem("fdl config check: --env needs a file to find the overlay next to; stdin has none")
                return EXIT_PROBLEMS
            files = [Path("<stdin>")]
            project = api.load_text(sys.stdin.read(), "<stdin>")
        elif args.file is not None:
            files = [Path(args.file)] + ([api.config_overlay_file(args.file, env)] if env is not None else [])
            project = api.load_config_file(args.file, env)
        else:
            directory = Path(args.project)
            files = [directory / api.BASE_FILE] + ([directory / f"fdl.{env}.yml"] if env is not None else [])
            files = [path for path in files if path.is_file()] or files[:1]
            project = api.load_config(directory, env)
    except api.ConfigError as error:
        for issue in error.issues:
            _problem(str(issue))
        _problem(f"fdl config check: {len(error.issues)} problem(s)")
        return EXIT_PROBLEMS
    problems: list[api.ConfigIssue] = []
    window = "no cluster: block"
    if project.cluster is not None:
        window, policy_issue = _window(project.cluster, files)
        if policy_issue is not None:
            problems.append(policy_issue)
    if problems:
        for issue in problems:
            _problem(str(issue))
        _problem(f"fdl config check: {len(problems)} problem(s)")
        return EXIT_PROBLEMS
    names = " + ".join(str(path) for path in files)
    print(f"{names}: OK — {_roster(project.cluster)}; {window}{_walk_in(project.join)}")
    return EXIT_OK


def _roster(cluster: api.ClusterConfig | None) -> str:
    if cluster is None:
        return "no roster"
    if not cluster.workers:
        return "roster: none (discovery: walk-ins only)"
    hosts = ", ".join(
        f"{worker.host} ({'all GPUs' if worker.rank_count is None else f'{worker.rank_count} rank(s)'})"
        for worker in cluster.workers
    )
    probed = f" + {len(cluster.hosts_to_probe)} host(s) counted at dispatch" if cluster.hosts_to_probe else ""
    return f"roster: {len(cluster.workers)} worker(s) {hosts}, capacity {cluster.explicit_capacity}{probed}"


def _walk_in(join: api.WalkInConfig | None) -> str:
    if join is None:
        return ""
    host, port = join.controller_endpoint()
    return f"; join: block dials {host}:{port}"


def _window(cluster: api.ClusterConfig, files: list[Path]) -> tuple[str, api.ConfigIssue | None]:
    """(the window's one-line summary, or a ConfigIssue for a knob contradiction the controller would
    refuse).
    """
    if cluster.hosts_to_probe:
        # Capacity (and so the default quorum and target) is known only once the `all` hosts are counted.
        return (f"window: averaging {cluster.controller.averaging.value}, checked at dispatch "
                "(local_devices: all)", None)  # fmt: skip
    options = api.ControllerOptions.from_cluster(cluster)
    try:
        policy = api.derive_policy(
            options.join,
            capacity=options.capacity,
            loopback_bind=options.wants_loopback,
            averaging=options.averaging,
        )
    except api.PolicyError as error:
        where = _locate(files, ("cluster", "controller", "join"))
        return "", api.ConfigIssue(
            ("cluster", "controller", "join"), str(error).removeprefix("controller.join: "), *where
        )
    summary = policy.summary().removeprefix("join window open (").removesuffix(")")
    return f"window: {summary}, averaging {options.averaging}", None


def _locate(files: list[Path], key_path: tuple[str, ...]) -> tuple[Path | None, int | None, int | None]:
    """The last file that writes `key_path` (or its nearest parent), with its line and column."""
    for path in reversed(files):
        if not path.is_file():
            continue
        try:
            positions = api.read_yaml(path).positions
        except api.ConfigError:
            continue
        for cut in range(len(key_path), 0, -1):
            where = positions.get(key_path[:cut])
            if where is not None:
                return where.file, where.line, where.column
    return (files[0] if files else None), None, None


COMMAND = Command("config", "configuration tools: fdl config check [FILE]", __doc__, configure_parser, main)
