"""Turn pydantic validation errors into ConfigIssues that name the key path, file and line.

pydantic locations contain union tags and validator names besides real keys; walking the location
against the data keeps only the steps that exist, which is the key path the operator wrote.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from flodld.config.errors import ConfigIssue, KeyPath, RuleViolation, RuleViolations
from flodld.config.yamlsource import Position

# Keys other tools spell differently; a plain edit-distance match would not find these.
_RENAMED_KEYS = {"bin": "program", "controller": "address", "devices": "local_devices", "ranks": None}

_PATTERN_HELP = {
    r"^[^\s/]+$": "must be a host name or address without spaces or '/'",
    r"^\S+$": "must not contain whitespace",
    r"^[^\s@]+$": "must be a user name without spaces or '@'",
    r"^[^\n\r]+$": "must be one line",
}


def issues_from_validation(
    exc: ValidationError,
    data: object,
    root_model: type[BaseModel],
    positions: Mapping[KeyPath, Position] | None = None,
    default_file: Path | None = None,
) -> list[ConfigIssue]:
    """One ConfigIssue per pydantic error (rule groups expand to one issue per rule)."""
    positions = positions or {}
    issues: list[ConfigIssue] = []
    for error in exc.errors(include_url=False):
        path, complete = _data_path(data, error["loc"])
        kind = error["type"]
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, RuleViolations | RuleViolation):
            violations = cause.violations if isinstance(cause, RuleViolations) else (cause,)
            for violation in violations:
                key_path = (*path, *violation.path)
                issues.append(_located(key_path, violation.message, positions, default_file))
            continue
        if kind == "extra_forbidden":
            key = error["loc"][-1]
            key_path = path if complete else (*path, key)
            message = _unknown_key_message(str(key), _model_at(root_model, key_path[:-1]))
        elif kind == "missing" and not complete:
            key_path = (*path, error["loc"][-1])
            message = f"missing required key {error['loc'][-1]!r}"
        else:
            key_path = path
            message = _describe(kind, error["msg"], error.get("input"), key_path)
        issues.append(_located(key_path, message, positions, default_file))
    return sorted(issues, key=lambda issue: (str(issue.file or ""), issue.line or 0, issue.column or 0))


def _located(
    key_path: KeyPath, message: str, positions: Mapping[KeyPath, Position], default_file: Path | None
) -> ConfigIssue:
    for cut in range(len(key_path), -1, -1):
        where = positions.get(key_path[:cut])
        if where is not None:
            return ConfigIssue(key_path, message, where.file, where.line, where.column)
    return ConfigIssue(key_path, message, default_file)


def _data_path(data: object, loc: tuple[int | str, ...]) -> tuple[KeyPath, bool]:
    """The part of `loc` that names real keys/items in `data`; `complete` if the last step was real."""
    path: list[str | int] = []
    node: Any = data  # walked under the isinstance checks below
    complete = True
    for part in loc:
        is_key = isinstance(node, dict) and isinstance(part, str) and part in node
        is_item = isinstance(node, list | tuple) and isinstance(part, int) and 0 <= part < len(node)
        if is_key or is_item:
            node = node[part]
            path.append(part)
        complete = is_key or is_item
    return tuple(path), complete


def _model_at(root_model: type[BaseModel], path: KeyPath) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root_model
    for part in path:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _find_model(model.model_fields[part].annotation)
    return model


def _find_model(annotation: object) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        found = _find_model(argument)
        if found is not None:
            return found
    return None


def _unknown_key_message(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return f"unknown key {key!r}"
    allowed = list(model.model_fields)
    message = f"unknown key {key!r}"
    renamed = _RENAMED_KEYS.get(key)
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if renamed in allowed:
        message += f"; did you mean {renamed!r}?"
    elif close:
        message += f"; did you mean {close[0]!r}?"
    elif key == "ranks":
        message += "; ranks are assigned at admission, list local_devices instead"
    return f"{message} (allowed here: {', '.join(allowed)})"


def _shorten(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(kind: str, pydantic_message: str, given: object, key_path: KeyPath) -> str:
    if kind == "value_error":
        return pydantic_message.removeprefix("Value error, ")
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {_shorten(given)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping (key: value lines), got {_shorten(given)}"
    if kind == "string_pattern_mismatch":
        pattern = next((p for p in _PATTERN_HELP if p in pydantic_message), None)
        help_text = _PATTERN_HELP[pattern] if pattern else pydantic_message
        return f"{_shorten(given)} {help_text}"
    if kind == "string_too_short":
        return "must not be empty"
    message = f"{pydantic_message}, got {_shorten(given)}"
    if kind == "string_type" and isinstance(given, int | float | bool) and "env" in key_path:
        message += ' (environment values are strings: quote it, e.g. "1")'
    elif kind == "string_type" and isinstance(given, int | float | bool):
        message += " (quote it in YAML to make it a string)"
    return message
