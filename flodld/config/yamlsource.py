"""Read one YAML file into plain Python data plus the line/column of every key path.

ruamel's round-trip loader keeps positions; we copy the document into plain dicts/lists/scalars
(so validation never sees ruamel types) and record where each key and list item was written.
Sizes are capped before anything is allocated: the file's bytes, the node count (alias bombs)
and the nesting depth.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.scalarbool import ScalarBoolean

from flodld.config.errors import ConfigError, ConfigIssue, KeyPath

MAX_FILE_BYTES = 1 << 20
MAX_NODES = 20_000
MAX_DEPTH = 64


@dataclass(frozen=True)
class Position:
    file: Path
    line: int  # 1-based
    column: int  # 1-based


@dataclass
class SourceDocument:
    """Plain data of one file and where each key path was written."""

    data: dict[str, Any]
    positions: dict[KeyPath, Position]


def read_yaml(path: Path) -> SourceDocument:
    """Parse `path`; any problem (I/O, syntax, shape, size) becomes a ConfigError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                ConfigIssue(
                    (), f"file is {size} bytes; configuration files are capped at {MAX_FILE_BYTES}", path
                )
            )
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(ConfigIssue((), f"cannot read the file: {exc}", path)) from exc
    return parse_yaml(text, path)


def parse_yaml(text: str, path: Path) -> SourceDocument:
    yaml = YAML(typ="rt")
    try:
        root = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        column = mark.column + 1 if mark is not None else None
        problem = " ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
        raise ConfigError(ConfigIssue((), f"YAML syntax error: {problem}", path, line, column)) from exc
    except (YAMLError, ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(ConfigIssue((), f"YAML syntax error: {exc}", path)) from exc
    if root is None:
        return SourceDocument(data={}, positions={(): Position(path, 1, 1)})
    if not isinstance(root, CommentedMap):
        raise ConfigError(
            ConfigIssue(
                (), f"the document must be a mapping of keys (cluster:, join:), got {_kind(root)}", path, 1, 1
            )
        )
    converter = _Converter(path)
    data = converter.convert(root, (), Position(path, 1, 1), depth=0)
    assert isinstance(data, dict)
    return SourceDocument(data=data, positions=converter.positions)


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"a {type(value).__name__}"


class _Converter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.positions: dict[KeyPath, Position] = {}
        self.nodes = 0

    def _fail(self, key_path: KeyPath, position: Position, message: str) -> ConfigError:
        return ConfigError(ConfigIssue(key_path, message, self.path, position.line, position.column))

    def convert(self, node: object, key_path: KeyPath, position: Position, depth: int) -> object:
        self.nodes += 1
        self.positions[key_path] = position
        if self.nodes > MAX_NODES:
            raise self._fail(
                key_path, position, f"document has more than {MAX_NODES} values (alias expansion?)"
            )
        if depth > MAX_DEPTH:
            raise self._fail(key_path, position, f"nesting deeper than {MAX_DEPTH} levels")
        # A self-referencing alias could only recurse until MAX_DEPTH, so no cycle check is needed.
        if isinstance(node, CommentedMap):
            return self._mapping(node, key_path, depth)
        if isinstance(node, CommentedSeq):
            return self._sequence(node, key_path, depth)
        return self._scalar(node, key_path, position)

    def _position_of(self, node: CommentedMap | CommentedSeq, key: object, parent: Position) -> Position:
        try:
            line, column = node.lc.key(key) if isinstance(node, CommentedMap) else node.lc.item(key)
        except (KeyError, IndexError, TypeError, AttributeError):
            return parent
        return Position(self.path, int(line) + 1, int(column) + 1)

    def _mapping(self, node: CommentedMap, key_path: KeyPath, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        parent = self.positions[key_path]
        for key in node:
            position = self._position_of(node, key, parent)
            if not isinstance(key, str):
                raise self._fail(key_path, position, f"keys must be strings, got {key!r}")
            result[key] = self.convert(node[key], (*key_path, key), position, depth + 1)
        return result

    def _sequence(self, node: CommentedSeq, key_path: KeyPath, depth: int) -> list[Any]:
        parent = self.positions[key_path]
        return [
            self.convert(item, (*key_path, index), self._position_of(node, index, parent), depth + 1)
            for index, item in enumerate(node)
        ]

    def _scalar(self, node: object, key_path: KeyPath, position: Position) -> object:
        # ruamel subclasses int/float/str to remember formatting; hand validation the plain types.
        if node is None or isinstance(node, bool):
            return node
        if isinstance(node, ScalarBoolean):  # an anchored boolean is an int subclass in ruamel
            return bool(node)
        if isinstance(node, int):
            return int(node)
        if isinstance(node, float):
            return float(node)
        if isinstance(node, str):
            return str(node)
        if isinstance(node, datetime.date):
            return node.isoformat()
        raise self._fail(key_path, position, f"unsupported YAML value {node!r} (tags are not allowed)")
