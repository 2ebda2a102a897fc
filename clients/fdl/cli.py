"""What the `fdl` command modules share: the sub-command table's type, `add_command`, `usage_error`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Final, Protocol

EXIT_USAGE: Final = 2
"""Every command's exit status for bad input (flags, config): retrying cannot help."""


class Subparsers(Protocol):
    """`ArgumentParser.add_subparsers()`'s result, as far as a command's `add_parser` uses it."""

    def add_parser(
        self,
        name: str,
        *,
        help: str | None = ...,
        description: str | None = ...,
        formatter_class: type[argparse.HelpFormatter] = ...,
    ) -> argparse.ArgumentParser: ...


def add_command(
    subparsers: Subparsers,
    name: str,
    summary: str,
    description: str | None,
    configure: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add `fdl NAME`: `summary` in `fdl --help`, `description` (the module's docstring) shown as
    written, its options from `configure`, and `main` as what runs it (`args.func`).
    """
    parser = subparsers.add_parser(
        name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure(parser)
    parser.set_defaults(func=main)
    return parser


def usage_error(command: str, error: Exception) -> int:
    """Say `fdl COMMAND: error` on stderr; returns the exit status for bad input (EXIT_USAGE)."""
    print(f"fdl {command}: {error}", file=sys.stderr)
    return EXIT_USAGE
