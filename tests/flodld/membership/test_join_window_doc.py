"""docs/join-window.md must describe the code that is there."""

from __future__ import annotations

import re
from pathlib import Path

from flodld.config.join import JoinConfig
from flodld.membership.phase import TRANSITIONS, render_mermaid
from flodld.membership.snapshot import StateSnapshot

DOC = (Path(__file__).resolve().parents[3] / "docs" / "join-window.md").read_text(encoding="utf-8")


def _mermaid_block() -> str:
    match = re.search(r"```mermaid\n(.*?)```", DOC, re.S)
    assert match, "docs/join-window.md has no mermaid block"
    return match.group(1)


def test_the_diagram_lists_exactly_the_transition_table() -> None:
    edges = set(re.findall(r"^\s*(\w+) --> (\w+): .*\[(\w+)\]$", _mermaid_block(), re.M))
    assert edges == {(s.value, t.value, e.value) for (s, e), t in TRANSITIONS.items()}


def test_the_diagram_is_the_generated_one() -> None:
    assert _mermaid_block() == render_mermaid(), "paste render_mermaid()'s output into docs/join-window.md"


def test_every_knob_is_in_the_knob_table() -> None:
    for knob in JoinConfig.model_fields:
        assert f"| `{knob}` |" in DOC, knob


def test_every_state_json_field_is_described() -> None:
    for field in StateSnapshot.model_fields:
        assert f"`{field}`" in DOC, field


def test_every_admission_code_is_described() -> None:
    codes = [
        "window_closed",
        "protocol_version",
        "duplicate_host",
        "unknown_host",
        "empty_devices",
        "too_many_devices",
        "declared_devices",
        "world_full",
        "vendor_mix",
        "dataset_mismatch",
        "run_id_mismatch",
        "nccl_skew",
        "model_mismatch",
    ]
    positions = [DOC.index(f"`{code}`") for code in codes]
    assert positions == sorted(positions), "admission codes must be documented in check order"
