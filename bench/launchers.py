"""What the launcher benchmarks (launch.py, ddp_step.py) share: the two launchers, started alike.

Each benchmark runs its own file as the program (`--as-rank`) under `torchrun --standalone` and under
`fdl run`, and reads one figure per rank from the output.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def find_torchrun() -> str | None:
    """The torchrun next to this interpreter, else on PATH; None (said on stderr) where there is none."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if found is None:
        print("torchrun not found next to this interpreter or on PATH", file=sys.stderr)
    return found


def torchrun_command(torchrun: str, ranks: int, program: Path, *args: str) -> list[str]:
    return [torchrun, "--standalone", f"--nproc-per-node={ranks}", str(program), *args]


def fdl_run_command(ranks: int, program: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "fdl.main", "run", "--ranks", str(ranks), str(program), "--", *args]


def rank_figures(command: list[str], ranks: int, pattern: str, timeout: float) -> list[float]:
    """Run COMMAND (one thread per rank) to its end; group 1 of PATTERN from each of its RANKS ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    figures = [float(found) for found in re.findall(pattern, done.stdout + done.stderr)]
    if done.returncode != 0 or len(figures) != ranks:
        raise RuntimeError(
            f"{command[:3]} failed (exit {done.returncode}, {len(figures)}/{ranks} ranks):\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        )
    return figures
