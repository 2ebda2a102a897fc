"""What every `fdl` command module shares with `fdl.main`: the type of the sub-command table."""

from __future__ import annotations

import argparse
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
