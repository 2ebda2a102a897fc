"""`flodld.run(main)` outside flodld: the user guide's own example, run with plain `python train.py`, is a
world of one (docs/user-guide.md, "Write a program").
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "user-guide.md"


def guide_example() -> str:
    """The first python block of the user guide, verbatim."""
    match = re.search(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert match is not None, "the user guide lost its example"
    return match.group(1)


def plain_env(**extra: str) -> dict[str, str]:
    import os

    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("FLODL_", "MASTER_", "TORCHELASTIC")) and name not in
           {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FDL_ENV"}}  # fmt: skip
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


@pytest.mark.timeout(120)
def test_the_user_guide_example_runs_as_a_world_of_one_under_plain_python(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(guide_example())
    done = subprocess.run([sys.executable, str(script)], env=plain_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "rank 0/1: 1.0", done.stdout + done.stderr


@pytest.mark.timeout(120)
def test_under_torchrun_variables_flodld_run_joins_that_world_instead(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(guide_example())
    env = plain_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "rank 0/1: 1.0", done.stdout + done.stderr


def test_a_plain_process_told_not_to_init_does_not_import_torch(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import sys, flodld\n"
        "sys.exit(flodld.run(lambda: 3 if 'torch' in sys.modules else 0, init_process_group=False))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], env=plain_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
