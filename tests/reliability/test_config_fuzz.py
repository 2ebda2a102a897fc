"""Fuzz the config loader from a valid cluster file: every refusal names the file, the line and the key."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from flodld.config import ConfigError, load_config
from flodld.config.errors import format_key_path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fdl.cluster.yml"
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ABSURD: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    10**6,
    1.5,
    float("inf"),
    "",
    "x" * 5000,
    "two words",
    "a/b",
    "cuda:-1",
    "cpu:0",
    "all",
    [],
    [-1],
    [10**6],
    ["gpu1"],
    {},
    {"unknown": 1},
    "127.0.0.1",
    "0" * 32,
    "zz",
]


def _load_example() -> dict[str, Any]:
    data = YAML(typ="safe").load(EXAMPLE.read_text())
    assert isinstance(data, dict)
    return data


BASE = _load_example()


def _leaf_paths(node: object, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    paths = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _leaf_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _leaf_paths(value, (*prefix, index))
    return paths


PATHS = _leaf_paths(BASE)


def _set(document: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    node: Any = document
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value


def _dump(document: dict[str, Any]) -> str:
    buffer = io.StringIO()
    YAML(typ="safe").dump(document, buffer)
    return buffer.getvalue()


def _related(issue_path: tuple[str | int, ...], mutated: tuple[str | int, ...]) -> bool:
    """The issue names the mutated key, an ancestor or descendant of it, or a sibling in the same mapping
    (a cross-field rule, e.g. a worker's `host` made loopback refused at its `tunnel: true`, names the key
    whose change fixes it).
    """
    shorter = min(len(issue_path), len(mutated))
    if shorter > 0 and issue_path[:shorter] == mutated[:shorter]:
        return True
    return len(issue_path) == len(mutated) > 1 and issue_path[:-1] == mutated[:-1]


def _assert_located(error: ConfigError, file: Path) -> None:
    assert error.issues
    for issue in error.issues:
        assert issue.file is not None and issue.file.name == file.name, issue
        assert issue.line is not None and issue.line >= 1, issue
        assert f"{issue.file}:{issue.line}" in str(error)
        assert format_key_path(issue.key_path) in str(error)


@FUZZ
@given(path=st.sampled_from(PATHS), value=st.sampled_from(ABSURD), rename=st.booleans())
def test_one_bad_value_or_key_anywhere_is_reported_with_file_line_and_key(
    tmp_path_factory: pytest.TempPathFactory, path: tuple[str | int, ...], value: object, rename: bool
) -> None:
    directory: Path = tmp_path_factory.mktemp("cfg")
    document = copy.deepcopy(BASE)
    if rename and isinstance(path[-1], str):
        parent: Any = document
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1] + "_typo"] = parent.pop(path[-1])
        mutated = (*path[:-1], path[-1] + "_typo")
    else:
        _set(document, path, value)
        mutated = path
    overlay = directory / "fdl.cluster.yml"
    overlay.write_text(_dump(document))
    try:
        load_config(directory, "cluster")
    except ConfigError as error:
        _assert_located(error, overlay)
        assert any(_related(issue.key_path, mutated) for issue in error.issues), (mutated, str(error))
    else:
        # Renamed keys are unknown keys, always refused, except inside free-form `env:` maps.
        assert mutated == path or "env" in path[:-1], mutated


@FUZZ
@given(
    lines=st.lists(
        st.sampled_from(
            [
                "cluster:",
                "  controller:",
                "    host: h",
                "    port: 1e9",
                "  workers:",
                "    - host: a",
                "      local_devices: [0",
                "      local_devices: [cpu:2]",
                "- ",
                ": x",
                "  : y",
                "\t",
                "  '",
                '  "',
                "{",
                "}",
                "&a b",
                "*a",
                "*missing",
                "!!python/object:os.system x",
                "  join: {token: 12}",
            ]
        ),
        min_size=1,
        max_size=12,
    )
)
def test_broken_yaml_is_reported_with_the_file_and_a_line(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str]
) -> None:
    directory: Path = tmp_path_factory.mktemp("yaml")
    target = directory / "fdl.yml"
    target.write_text("\n".join(lines) + "\n")
    try:
        load_config(directory)
    except ConfigError as error:
        for issue in error.issues:
            assert issue.file == target, issue
            assert issue.line is not None, f"no line number in: {issue}"
            assert str(target) in str(error)


def test_a_python_object_tag_is_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    (tmp_path / "fdl.yml").write_text(f"cluster: !!python/object/apply:os.system ['touch {marker}']\n")
    try:
        load_config(tmp_path)
    except ConfigError as error:
        assert "fdl.yml:1" in str(error)
    else:
        raise AssertionError("a python tag was accepted")
    assert not marker.exists()


def test_an_alias_bomb_is_refused_with_its_location(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    (tmp_path / "fdl.yml").write_text("\n".join(lines) + "\n")
    try:
        load_config(tmp_path)
    except ConfigError as error:
        assert error.issues[0].file is not None and error.issues[0].line is not None
        assert "20000" in str(error) or "20 000" in str(error) or "more than" in str(error)
    else:
        raise AssertionError("an alias bomb was accepted")
