"""PROGRAM and its arguments on an fdl command line, shared by `fdl run` and `fdl join`.

`add_rest` takes everything after the command's options as one REMAINDER positional, `reparse`
finishes parsing it (options may follow the positional; a `--` ends ours and starts PROGRAM's), and
`program_command` turns PROGRAM into the rank's command line. Both commands import this module, and
neither imports the other for it (`fdl run` walks in through `fdl.join`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def add_rest(parser: argparse.ArgumentParser, *, metavar: str, help: str) -> None:
    """The positional `rest`: everything after the options, which `reparse` finishes parsing."""
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar=metavar, help=help)


def split_at_dashdash(rest: list[str]) -> tuple[list[str], list[str] | None]:
    """(our words, PROGRAM's arguments) split at the first `--`; None when there was no `--`."""
    if "--" in rest:
        index = rest.index("--")
        return rest[:index], rest[index + 1 :]
    return rest, None


def reparse(
    args: argparse.Namespace,
    add_options: Callable[[argparse.ArgumentParser], object],
    positional: Callable[[argparse.ArgumentParser], object],
) -> list[str] | None:
    """Finish parsing what `add_rest`'s REMAINDER swallowed (options may follow it), into `args`."""
    head, tail = split_at_dashdash(list(args.rest))
    parser = argparse.ArgumentParser(add_help=False, prog="fdl")
    add_options(parser)
    positional(parser)
    parser.parse_args(head, namespace=args)
    return tail


def program_command(program: str, args: list[str]) -> list[str]:
    """How to start PROGRAM: Python files with this interpreter, anything else as an executable."""
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise FileNotFoundError(f"program {program!r} not found (relative to {os.getcwd()})")
        return [sys.executable, program, *args]
    found = (
        shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    )
    if found is None:
        raise FileNotFoundError(f"program {program!r} is neither a .py file nor an executable on PATH")
    return [found, *args]
