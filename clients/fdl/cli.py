"""What the `fdl` command modules share: the sub-command table's type, `Command`, `usage_error`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

EXIT_USAGE: Final = 2
"""Every command's exit status for bad input (flags, config): retrying cannot help."""


class Subparsers(Protocol):
    """`ArgumentParser.add_subparsers()`'s result, as far as `Command.add_to` uses it."""

    def add_parser(
        self,
        name: str,
        *,
        help: str | None = ...,
        description: str | None = ...,
        formatter_class: type[argparse.HelpFormatter] = ...,
    ) -> argparse.ArgumentParser: ...


@dataclass(frozen=True)
class Command:
    """One `fdl` subcommand, as one value each command module names `COMMAND`.

    `summary` is its line in `fdl --help`; `description` (the module's docstring) is its own `--help`
    text, shown as written; `configure` adds its options; `main` runs it and returns the exit status.
    """

    name: str
    summary: str
    description: str | None
    configure: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]

    def add_to(self, subparsers: Subparsers) -> argparse.ArgumentParser:
        """Add `fdl NAME` to `fdl`'s sub-command table, with `main` as what runs it (`args.func`)."""
        parser = subparsers.add_parser(
            self.name, help=self.summary, description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        self.configure(parser)
        parser.set_defaults(func=self.main)
        return parser

    def standalone(self, argv: Sequence[str] | None = None) -> int:
        """Run the command on its own (`python -m fdl.<module>`): its parser, no overlay selection."""
        parser = argparse.ArgumentParser(
            prog=f"fdl {self.name}", description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        self.configure(parser)
        return self.main(parser.parse_args(argv))


def usage_error(command: str, error: Exception) -> int:
    """Say `fdl COMMAND: error` on stderr; returns the exit status for bad input (EXIT_USAGE)."""
    print(f"fdl {command}: {error}", file=sys.stderr)
    return EXIT_USAGE
