"""`fdl`: the thin command-line client. Overlay selection is shared by every command.

Selecting an overlay (`fdl.<env>.yml`): `fdl @env <cmd>` (only before the command),
`fdl --env env <cmd>` (anywhere before `--`, and for `fdl run` before PROGRAM: the words after it are
PROGRAM's), or `FDL_ENV=env`; the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fdl import config as config_command
from fdl import join as join_command
from fdl import join_sshd, logs, probe, start, status
from fdl import run as run_command
from flodld import api

# The subcommands, in `fdl --help` order: one `fdl.cli.Command` each, named COMMAND in its module.
COMMANDS = tuple(
    module.COMMAND
    for module in (status, start, probe, join_sshd, config_command, run_command, join_command, logs)
)


class UsageError(Exception):
    pass


def split_env(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take the overlay selector out of argv: `@env` first, or `--env NAME` / `--env=NAME` before `--`."""
    words = list(argv)
    env: str | None = None
    if words and words[0].startswith("@"):
        env = words.pop(0)[1:]
        if not env:
            raise UsageError("`@` needs an environment name, e.g. `fdl @cluster status`")
    rest: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            rest.extend(words[index:])
            break
        if word == "--env":
            if index + 1 >= len(words):
                raise UsageError("--env needs an environment name, e.g. `fdl --env cluster status`")
            env = words[index + 1]
            index += 2
            continue
        if word.startswith("--env="):
            env = word.split("=", 1)[1]
        else:
            rest.append(word)
        index += 1
    return env, rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fdl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", dest="env_flag", metavar="ENV", help="use the fdl.<ENV>.yml overlay")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_to(subparsers)
    return parser


def check_env(env: str, project: Path | str) -> None:
    """Refuse an overlay that does not exist, listing the ones that do."""
    envs = api.available_envs(project)
    if env not in envs:
        listing = ", ".join(envs) if envs else f"none (no fdl.<env>.yml in {Path(project).resolve()})"
        raise UsageError(f"unknown environment {env!r}: no fdl.{env}.yml; available overlays: {listing}")


def split_program_words(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """(fdl's words, `fdl run`'s PROGRAM and its arguments): the latter are the program's alone, so that
    an `--env` among them is never taken for the overlay selector.
    """
    words = list(words)
    index = 1 if words[:1] and words[0].startswith("@") else 0
    while index < len(words) and words[index].startswith("-") and words[index] != "--":
        index += 2 if words[index] == "--env" else 1  # the only top-level option with a separate value
    if index >= len(words) or words[index] != "run":
        return words, []
    start = index + 1 + run_command.program_start(words[index + 1 :])
    return words[:start], words[start:]


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        words, program = split_program_words(words)
        env, rest = split_env(words)
        rest += program
        args = build_parser().parse_args(rest)
        env = env or args.env_flag or os.environ.get("FDL_ENV") or None
        args.env = env
        if env is not None:
            if not getattr(args, "env_checked_by_command", False):
                check_env(env, getattr(args, "project", "."))
            os.environ["FDL_ENV"] = env
    except UsageError as error:
        print(f"fdl: {error}", file=sys.stderr)
        return 2
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
