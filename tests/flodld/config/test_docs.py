"""The complete YAML examples in docs/config.md load, so the reference cannot drift from the models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flodld.config import load_text

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"
BLOCKS = [block for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S) if "..." not in block]


def test_the_reference_has_complete_examples() -> None:
    assert BLOCKS


@pytest.mark.parametrize("block", BLOCKS)
def test_yaml_examples_in_the_reference_load(block: str) -> None:
    load_text(block, name="docs/config.md")
