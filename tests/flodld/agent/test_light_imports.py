"""The light processes stay light: the agent, the relay, `import flodld`, the rank launcher and `fdl` load no
torch, and the agent and relay no HTTP server (aiohttp comes with the controller package only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "aiohttp")

LIGHT = {
    "flodld": ("torch",),
    "flodld.agent.run": HEAVY,
    "flodld.relay.server": HEAVY,
    "flodld.launcher": HEAVY,
    "flodld.launcher.rank": ("torch",),
    "flodld.api": ("torch",),
    "fdl.main": ("torch",),
}


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_a_light_module_loads_nothing_heavy(module: str) -> None:
    code = (
        "import json, sys\n"
        f"import {module}\n"
        f"print(json.dumps([name for name in {list(LIGHT[module])!r} if name in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], f"importing {module} loaded these"
