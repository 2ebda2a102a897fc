"""Every process-group feature works through flodld (issue 20, goal 2): one row per test, each at 4 gloo
CPU ranks under `fdl run` (pipelining on 2), both as a stock torchrun script (env:// through the agent's
loopback TCPStore endpoint) and through `flodld.run` (the controller store directly, a Python Store that
torch's C++ groups call back into).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.harness import PROGRAMS, Fdl, child_env

pytestmark = pytest.mark.multiproc

FEATURES = str(PROGRAMS / "torchrun_features.py")
ROWS = [
    "ddp",
    "object_collectives",
    "monitored_barrier",
    "split_group",
    "fsdp2_hsdp",
    "tensor_parallel",
    "pipelining",
    "checkpoint",
]


@pytest.mark.parametrize("via", ["env", "flodld"])
@pytest.mark.parametrize("row", ROWS)
def test_a_process_group_feature_works_under_fdl_run(row: str, via: str, tmp_path: Path) -> None:
    ranks = 2 if row == "pipelining" else 4
    env = child_env(FEATURES_VIA_FLODLD="1" if via == "flodld" else "0")
    run = Fdl("run", "--ranks", str(ranks), FEATURES, "--", row, str(tmp_path / "checkpoint"), env=env)
    assert run.wait(300) == 0, run.output[-6000:]
    unsupported = re.findall(rf"{row} unsupported rank=\d: (.*)", run.output)
    if unsupported:
        pytest.skip(f"torch {row}: {unsupported[0]} (the same under torchrun)")
    assert sorted(re.findall(rf"{row} ok rank=(\d)", run.output)) == [str(r) for r in range(ranks)], (
        run.output[-6000:]
    )
