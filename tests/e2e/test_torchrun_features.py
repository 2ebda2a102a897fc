"""Every process-group feature works through flodld (issue 20, goal 2): one row per test, at 4 gloo CPU
ranks under `fdl run` (pipelining on 2), both as a stock torchrun script (env:// through the agent's
loopback TCPStore endpoint) and through `flodld.run` (the controller store directly, a Python Store that
torch's C++ groups call back into). The rows but pipelining run one after another in one `fdl run` per way
(the program's row `every`, shared by this module's tests); each test checks its own row in that run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[int, str, int]]:
    """`(row, via) -> (exit code, output, ranks)` of the run that exercised the row: `every` at 4 ranks, or
    `pipelining` at 2; each run once per module, shared by its rows' tests.
    """
    done: dict[tuple[str, str], tuple[int, str, int]] = {}

    def run(row: str, via: str) -> tuple[int, str, int]:
        which = "pipelining" if row == "pipelining" else "every"
        if (which, via) not in done:
            ranks = 2 if which == "pipelining" else 4
            env = child_env(FEATURES_VIA_FLODLD="1" if via == "flodld" else "0")
            directory = tmp_path_factory.mktemp(f"{which}-{via}")
            fdl = Fdl(
                "run", "--ranks", str(ranks), FEATURES, "--", which, str(directory / "checkpoint"), env=env
            )
            done[which, via] = (fdl.wait(300), fdl.output, ranks)
        return done[which, via]

    return run


@pytest.mark.parametrize("via", ["env", "flodld"])
@pytest.mark.parametrize("row", ROWS)
def test_a_process_group_feature_works_under_fdl_run(
    row: str, via: str, feature_run: Callable[[str, str], tuple[int, str, int]]
) -> None:
    code, output, ranks = feature_run(row, via)
    assert code == 0, output[-6000:]
    unsupported = re.findall(rf"{row} unsupported rank=\d: (.*)", output)
    if unsupported:
        pytest.skip(f"torch {row}: {unsupported[0]} (the same under torchrun)")
    ok = sorted(re.findall(rf"{row} ok rank=(\d)", output))
    assert ok == [str(r) for r in range(ranks)], output[-6000:]
