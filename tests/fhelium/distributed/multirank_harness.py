"""Run a world of real rank processes (gloo on 127.0.0.1) and collect their scenario results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANK_MAIN = Path(__file__).resolve().parent / "rank_main.py"
REPO_ROOT = Path(__file__).resolve().parents[3]
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class WorldRun:
    world_size: int
    results: list[dict[str, Any]]  # per global rank: scenario name -> result
    exit_codes: list[int | None]
    logs: list[str]

    def scenario(self, name: str) -> list[dict[str, Any]]:
        """Per-rank results of one scenario; fails with every rank's log if any rank lacks it."""
        missing = [rank for rank, result in enumerate(self.results) if name not in result]
        assert not missing, f"ranks {missing} never finished scenario {name!r}:\n" + self.log_tail()
        return [result[name] for result in self.results]

    def assert_ok(self, name: str) -> list[Any]:
        per_rank = self.scenario(name)
        failures = {rank: r.get("trace") or r.get("error") for rank, r in enumerate(per_rank) if not r["ok"]}
        assert not failures, f"scenario {name!r} failed on ranks {sorted(failures)}:\n" + "\n".join(
            f"--- rank {rank}:\n{text}" for rank, text in failures.items()
        )
        return [r["data"] for r in per_rank]

    def log_tail(self) -> str:
        return "\n".join(
            f"--- rank {rank} (exit {code}):\n{log[-3000:]}"
            for rank, (code, log) in enumerate(zip(self.exit_codes, self.logs, strict=True))
        )


def _group_alive(process_group: int) -> bool:
    try:
        os.killpg(process_group, 0)
    except ProcessLookupError:
        return False
    return True


def run_world(
    world_size: int,
    suite: str,
    workdir: Path,
    *,
    timeout_s: float = 100.0,
    pg_timeout_s: float = 30.0,
    rendezvous: str = "torchrun",
    cuda: bool = False,
    backend: str | None = None,
    shared_gpu: bool = False,
) -> WorldRun:
    """Launch ``world_size`` forked ranks; kill the whole world if it outlives ``timeout_s``.

    ``rendezvous``: ``torchrun`` (environment variables), ``store`` (an explicit FileStore) or
    ``none`` (world of one without any rendezvous). Without ``cuda`` the ranks see no GPU, so
    CPU tests behave the same on GPU machines; ``shared_gpu`` puts every rank on ``cuda:0``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        FHELIUM_TEST_PG_TIMEOUT=str(pg_timeout_s),
        FHELIUM_TEST_BACKEND=backend or "",
        FHELIUM_TEST_SHARED_GPU="1" if shared_gpu else "0",
    )
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, str(RANK_MAIN), suite, str(workdir), str(world_size), rendezvous]
    with (workdir / "launcher.log").open("wb") as log:
        launcher = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
        try:
            launcher.wait(timeout=timeout_s)
        finally:  # on timeout, or if pytest-timeout interrupts us: no rank outlives the test
            if launcher.poll() is None or _group_alive(launcher.pid):
                os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and every rank it forked
                launcher.wait()
    codes_path = workdir / "exit-codes.json"
    exit_codes: list[int | None] = (
        json.loads(codes_path.read_text()) if codes_path.exists() else [None] * world_size
    )
    results, logs = [], []
    for rank in range(world_size):
        path, log_path = workdir / f"rank-{rank}.json", workdir / f"rank-{rank}.log"
        results.append(json.loads(path.read_text()) if path.exists() else {})
        logs.append(log_path.read_text(errors="replace") if log_path.exists() else "")
    logs[0] = (workdir / "launcher.log").read_text(errors="replace") + logs[0]
    return WorldRun(world_size, results, exit_codes, logs)
