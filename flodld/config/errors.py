"""Configuration errors that point at the exact file, line and key an operator must fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KeyPath = tuple[str | int, ...]


def format_key_path(path: KeyPath) -> str:
    """`("cluster", "workers", 1, "ssh")` -> `cluster.workers[1].ssh`; the root is `<document>`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text or "<document>"


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: where it is (file and 1-based line/column when known) and what is allowed instead."""

    key_path: KeyPath
    message: str
    file: Path | None = None
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = str(self.file)
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        return f"{where}{format_key_path(self.key_path)}: {self.message}"


class ConfigError(ValueError):
    """The configuration cannot be used; `issues` lists every problem found, `str()` shows them all."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue | str) -> None:
        if isinstance(issues, str):
            issues = [ConfigIssue(key_path=(), message=issues)]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        if len(self.issues) == 1:
            text = str(self.issues[0])
        else:
            text = f"{len(self.issues)} configuration problems:\n" + "\n".join(
                f"  - {issue}" for issue in self.issues
            )
        super().__init__(text)


class ConfigNotFoundError(ConfigError):
    """Neither fdl.yml nor the requested overlay exists; callers may fall back to `embedded_default`."""


class RuleViolation(ValueError):
    """Raised inside model validators; `path` is relative to the model that raised it.

    The loader adds the model's own location to `path` so the error lands on the offending key's line.
    """

    def __init__(self, path: KeyPath, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


class RuleViolations(ValueError):
    """Several rule violations found by one model validator, reported together."""

    def __init__(self, violations: list[RuleViolation]) -> None:
        super().__init__("; ".join(f"{v.path}: {v.message}" for v in violations))
        self.violations = tuple(violations)
