"""`fdl join` arguments as its main() sees them, and a project folder to resolve them in."""

from __future__ import annotations

import argparse
from pathlib import Path

from fdl import join as join_command
from fdl.progargs import reparse


def parse(*words: str) -> argparse.Namespace:
    """WORDS parsed as `fdl join WORDS` is, program arguments after the controller included."""
    parser = argparse.ArgumentParser()
    join_command.configure_parser(parser)
    args = parser.parse_args(list(words))
    args.program_args = reparse(
        args, join_command._add_options, lambda p: p.add_argument("controller", nargs="?")
    )
    return args


def project(tmp_path: Path, block: str = "join: {}\n") -> Path:
    """TMP_PATH as a project: a train.py and an fdl.yml holding BLOCK."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "fdl.yml").write_text(block)
    return tmp_path
