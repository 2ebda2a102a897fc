"""What every `fdl` command module shares with `fdl.main`: the sub-command table's type, `add_command`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Protocol


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
