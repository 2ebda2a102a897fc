"""Restarts (`fdl run --max-restarts`): a failed attempt is re-formed as a fresh world, as torchrun does.

A stock script that checkpoints and resumes, with one rank SIGKILLed mid-run on the first attempt, ends
with the same parameters as a fault-free run, under `fdl run` and under torchrun alike.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.harness import PROGRAMS, Fdl, child_env, pid_alive

pytestmark = pytest.mark.multiproc

SCRIPT = str(PROGRAMS / "checkpoint_resume.py")
STEPS, EVERY, FAULT_STEP, FAULT_RANK = "8", "2", "5", "1"


def kill_everything_started_for(out: Path, process: subprocess.Popen[bytes]) -> None:
    """Torchrun's process group and every process whose command line names `out` (its workers, which a
    hung restart may leave in other groups): nothing of a trial outlives it.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if str(out).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
    process.wait()


def attempts(out: Path) -> list[tuple[int, int, int]]:
    rows = [tuple(int(x) for x in line.split()) for line in (out / "attempts.txt").read_text().splitlines()]
    return sorted((r[0], r[1], r[2]) for r in rows)


def warm_flags(out: Path) -> list[int]:
    return [int(line.split()[3]) for line in sorted((out / "attempts.txt").read_text().splitlines())]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    out = tmp_path_factory.mktemp("fault-free")
    run = Fdl("run", "--nproc-per-node", "2", SCRIPT, "--", str(out), STEPS, EVERY)
    assert run.wait() == 0, run.output
    return torch.load(out / "final.pt")


def test_a_killed_rank_is_restarted_once_and_the_script_resumes_to_the_fault_free_result(
    tmp_path: Path, fault_free: torch.Tensor
) -> None:
    run = Fdl(
        "run", "--nproc-per-node", "2", "--max-restarts", "2",
        SCRIPT, "--", str(tmp_path), STEPS, EVERY, FAULT_STEP, FAULT_RANK,
    )  # fmt: skip
    assert run.wait() == 0, run.output
    assert "restarting: attempt 2 of at most 3 (restart 1)" in run.output
    assert "attempt 1 failed: 1 of 2 ranks failed (ranks [1])" in run.output
    assert "flodld agent: rank 1 exited with signal 9" in run.output
    assert re.search(r"run done: .*\(after 1 restart\(s\): attempt 1: ", run.output), run.output
    # attempt 1 started both ranks at step 1; attempt 2 (TORCHELASTIC_RESTART_COUNT=1) resumed after step 4
    assert attempts(tmp_path) == [(0, 0, 1), (0, 1, 5), (1, 0, 1), (1, 1, 5)]
    # every rank of both attempts was a warm rank (attempt 2's from the standby agents started in attempt 1)
    assert warm_flags(tmp_path) == [1, 1, 1, 1], (tmp_path / "attempts.txt").read_text()
    assert "warm rank not used" not in run.output
    assert torch.equal(torch.load(tmp_path / "final.pt"), fault_free)


@pytest.mark.timeout(240)
def test_the_same_script_under_torchrun_max_restarts_gives_the_same_result(
    tmp_path: Path, fault_free: torch.Tensor
) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    # torchrun's own restart often fails here before the script runs: the new ranks' gloo mesh dials the
    # killed rank's old address from torchrun's store ("Gloo connectFullMesh failed ... Connection
    # refused"), and it may spend every restart that way (2 of 4 runs on this machine). That is torchrun's
    # rendezvous, not the script: such a run is tried again (fdl run forms each attempt in a fresh store
    # namespace and restarts once). What is compared is the result of a torchrun run that completed; when
    # none completes the test reports an expected failure naming torchrun, not a pass.
    outputs = []
    for trial in range(3):
        out = tmp_path / f"trial{trial}"
        out.mkdir()
        log = out / "torchrun.log"
        with open(log, "w") as sink:
            process = subprocess.Popen(
                [torchrun, "--standalone", "--nproc-per-node=2", "--max-restarts=2",
                 SCRIPT, str(out), STEPS, EVERY, FAULT_STEP, FAULT_RANK],
                env=child_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                code: int | None = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                kill_everything_started_for(out, process)
        if code == 0:
            break
        outputs.append(("timed out: " if code is None else f"exit {code}: ") + log.read_text()[-3000:])
    else:
        # torchrun's rendezvous, not the script and not fdl run, failed every trial: there is no torchrun
        # result to compare with. Said as an expected failure (with torchrun's output), never as a pass.
        pytest.xfail("torchrun's own restart never completed in 3 trials:\n" + "\n----\n".join(outputs))
    rows = attempts(out)
    assert [row for row in rows if row[1] == 0] == [(0, 0, 1), (1, 0, 1)]
    resumed = {row[1] for row in rows if row[1] > 0 and row[2] == 5}
    assert len(resumed) == 1 and [row[0] for row in rows if row[1] in resumed] == [0, 1], rows
    assert torch.equal(torch.load(out / "final.pt"), fault_free)


def test_exhausted_restarts_fail_the_run_naming_every_attempts_cause_and_leave_no_process() -> None:
    run = Fdl(
        "run", "--nproc-per-node", "2", "--max-restarts", "1",
        str(PROGRAMS / "sleeper.py"), "--", "--fail-rank", "1", "--code", "3",
    )  # fmt: skip
    pids = [int(m[2]) for m in run.wait_for(r"ready rank=(\d+) pid=(\d+) ppid=(\d+)", count=4)]
    assert run.wait() == 1, run.output
    summary = re.search(r"run FAILED after 2 attempts \(max_restarts \(1\) exhausted\): (.*)", run.output)
    assert summary is not None, run.output
    assert summary[1].count("1 of 2 ranks failed (ranks [1])") == 2, summary[1]
    assert "attempt 1: " in summary[1] and "attempt 2: " in summary[1]
    assert not any(pid_alive(pid) for pid in pids)


def test_without_max_restarts_a_failure_still_ends_the_run(tmp_path: Path) -> None:
    args = [str(tmp_path), STEPS, EVERY, FAULT_STEP, FAULT_RANK]
    run = Fdl("run", "--nproc-per-node", "2", SCRIPT, "--", *args)
    assert run.wait() == 1, run.output
    assert "restarting" not in run.output
    assert "run FAILED: 1 of 2 ranks failed (ranks [1])" in run.output
