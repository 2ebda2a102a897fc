"""Small helpers for config tests: write YAML files and collect the issues a load raises."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flodld.config import ConfigError, ConfigIssue, load_config


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def load_issues(directory: Path, env: str | None = None) -> tuple[ConfigIssue, ...]:
    with pytest.raises(ConfigError) as caught:
        load_config(directory, env)
    return caught.value.issues


def only_issue(directory: Path, env: str | None = None) -> ConfigIssue:
    issues = load_issues(directory, env)
    assert len(issues) == 1, [str(issue) for issue in issues]
    return issues[0]
