"""Fuzz the loader: any text yields a ProjectConfig or a ConfigError, never another exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from flodld.config import ConfigError, ProjectConfig, load_text
from flodld.config.loader import load_config

KEYS = [
    "cluster", "join", "controller", "workers", "env", "host", "port", "path", "local_devices", "ssh",
    "target", "tunnel", "averaging", "backend", "cadence", "token", "address", "devices", "options",
    "nccl_socket_ifname", "discovery", "min_rank_start", "program", "args", "persist", "x",
]  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.sampled_from(["all", "cpu", "cpu:2", "cuda:1", "127.0.0.1", "cpu_sync", "nccl", "", "a b"]),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=5),
    max_leaves=25,
)
DOCUMENTS = st.dictionaries(st.sampled_from(["cluster", "join", "other"]), VALUES, max_size=3)

YAML_PIECES = st.sampled_from(
    [
        "cluster:",
        "join:",
        "  controller:",
        "    host: h",
        "  workers:",
        "    - host: a",
        "      local_devices: [0]",
        "- ",
        ": ",
        "[",
        "]",
        "{",
        "}",
        "&a ",
        "*a",
        "!t ",
        "'",
        '"',
        "\t",
        "  ",
        "\n",
        "#",
        "? ",
        "|",
        ">",
        "%YAML 1.2",
        "---",
        "...",
        "\x00",
        "\ud7ff",
        "port: 1e9",
        "token: 0x1f",
    ]
)


def _check(text: str) -> None:
    try:
        result = load_text(text)
    except ConfigError as exc:
        assert str(exc)
        for issue in exc.issues:
            assert issue.message
    else:
        assert isinstance(result, ProjectConfig)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS)
def test_structured_documents_give_a_model_or_config_error(document: dict[str, Any]) -> None:
    import io

    buffer = io.StringIO()
    YAML(typ="safe").dump(document, buffer)
    _check(buffer.getvalue())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(YAML_PIECES, max_size=30).map("".join))
def test_yaml_fragments_give_a_model_or_config_error(text: str) -> None:
    _check(text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_gives_a_model_or_config_error(text: str) -> None:
    _check(text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=DOCUMENTS, overlay=DOCUMENTS)
def test_overlay_merge_of_random_documents_never_crashes(
    tmp_path: Path, base: object, overlay: object
) -> None:
    yaml = YAML(typ="safe")
    with (tmp_path / "fdl.yml").open("w") as handle:
        yaml.dump(base, handle)
    with (tmp_path / "fdl.fuzz.yml").open("w") as handle:
        yaml.dump(overlay, handle)
    try:
        load_config(tmp_path, "fuzz")
    except ConfigError as exc:
        assert exc.issues
