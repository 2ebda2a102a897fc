"""The `fdl` sub-command table: every command module is listed once, and each runs on its own too."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import fdl
import pytest
from fdl import cli
from fdl.main import COMMANDS, build_parser


def _command_modules() -> list[str]:
    names = [info.name for info in pkgutil.iter_modules(fdl.__path__)]
    return sorted(name for name in names if hasattr(importlib.import_module(f"fdl.{name}"), "COMMAND"))


def test_every_command_module_is_in_the_table_once() -> None:
    listed = [command.main.__module__ for command in COMMANDS]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == [f"fdl.{name}" for name in _command_modules()]
    assert [command.name for command in COMMANDS] == [
        "status", "start", "probe", "join-sshd", "config", "run", "join", "logs"
    ]  # fmt: skip


def test_top_level_help_lists_each_summary(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for command in COMMANDS:
        assert command.name in text and " ".join(command.summary.split()) in text


def test_a_command_parsed_by_fdl_runs_its_own_main() -> None:
    args = build_parser().parse_args(["start", "--addr", "127.0.0.1:9"])
    assert args.func is importlib.import_module("fdl.start").COMMAND.main


def test_standalone_uses_the_commands_own_parser(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[object] = []

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--level", type=int, required=True)

    def main(args: argparse.Namespace) -> int:
        seen.append(args.level)
        return 7

    command = cli.Command("probe-like", "a summary", "the docstring", configure, main)
    assert command.standalone(["--level", "3"]) == 7 and seen == [3]
    with pytest.raises(SystemExit) as exit_info:
        command.standalone(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fdl probe-like") and "the docstring" in out
