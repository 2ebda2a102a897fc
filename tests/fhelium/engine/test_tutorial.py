"""The tutorial's code blocks run as written (on the toy ring, so the test stays fast)."""

from __future__ import annotations

import re
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[3] / "docs" / "fhelium-tutorial.md"


def test_tutorial_code_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S)
    assert len(blocks) >= 5
    code = "\n".join(blocks)
    code = code.replace("Preset.SLOTS8192_SCALE40_DEPTH4", "Preset.TOY_N1024")
    code = code.replace('"x.fhe"', repr(str(tmp_path / "x.fhe")))
    code += "\nassert float((result.real - x * y).abs().max()) < 1e-4\n"
    exec(compile(code, str(TUTORIAL), "exec"), {})
