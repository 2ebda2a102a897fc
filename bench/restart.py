"""Restart latency: a rank SIGKILLed mid-run → every rank of the next attempt past init_process_group.

    .venv/bin/python bench/restart.py [--rounds 3] [--ranks 2]

The same stock script (no flodld import) runs under `fdl run --max-restarts 3` and under
`torchrun --standalone --max-restarts 3`, alternating, in the same invocation. Its rank 1 SIGKILLs
itself after one all-reduce of the first attempt, writing the time first; every rank of every later
attempt writes the time at which its `init_process_group` returned. The latency of a launcher is the
time from the kill to the last rank of the first attempt whose ranks all got past init (an attempt
whose rendezvous fails counts towards it: that is the launcher's restart time). Per round both
latencies; last line: the medians' ratio, fdl run over torchrun (the issue's goal is <= 0.5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    '''
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    out = sys.argv[1]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if restart:
        with open(os.path.join(out, f"init.{restart}.{rank}"), "w") as f:
            f.write(repr(time.time()))
    t = torch.ones(1)
    dist.all_reduce(t)
    if restart == 0 and rank == 1:
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
    '''
)


def latency(out: Path, ranks: int) -> float:
    killed = float((out / "killed").read_text())
    attempts: dict[int, list[float]] = {}
    for path in out.glob("init.*.*"):
        _, attempt, _rank = path.name.split(".")
        attempts.setdefault(int(attempt), []).append(float(path.read_text()))
    complete = [times for _, times in sorted(attempts.items()) if len(times) == ranks]
    if not complete:
        raise RuntimeError(f"no attempt after the kill got every rank past init: {sorted(attempts)}")
    return max(complete[0]) - killed


def run(command: list[str], out: Path, timeout: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code = process.wait(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_naming(out)  # a hung launcher's workers may sit in other process groups
    if code != 0:
        raise RuntimeError(f"{command[0]} exited {code}")


def _kill_naming(out: Path) -> None:
    """SIGKILL every process whose command line names `out` (each trial's scratch directory)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if str(out).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    torchrun = shutil.which("torchrun", path=str(bin_dir))
    if torchrun is None:
        print("torchrun not found next to this python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "restart_program.py"
        script.write_text(SCRIPT)
        launchers: dict[str, Callable[[Path], list[str]]] = {
            "fdl run": lambda out: [sys.executable, "-m", "fdl.main", "run", "--nproc-per-node",
                                    str(args.ranks), "--max-restarts", "3", str(script), str(out)],
            "torchrun": lambda out: [torchrun, "--standalone", f"--nproc-per-node={args.ranks}",
                                     "--max-restarts=3", str(script), str(out)],
        }  # fmt: skip
        results: dict[str, list[float]] = {name: [] for name in launchers}
        for round_number in range(args.rounds):
            row = []
            for name, command in launchers.items():
                out = Path(tempfile.mkdtemp(dir=scratch))
                try:
                    run(command(out), out, args.timeout)
                    value = latency(out, args.ranks)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    row.append(f"{name} failed ({error})")
                    continue
                results[name].append(value)
                row.append(f"{name} {value:.2f} s")
            print(f"round {round_number + 1}: " + ", ".join(row), flush=True)
    if not results["fdl run"] or not results["torchrun"]:
        print("not enough completed runs for a ratio", file=sys.stderr)
        return 1
    ours, theirs = statistics.median(results["fdl run"]), statistics.median(results["torchrun"])
    spread = {name: f"{min(v):.2f}-{max(v):.2f} s" for name, v in results.items()}
    print(f"restart latency median: fdl run {ours:.2f} s, torchrun {theirs:.2f} s (spread {spread}); "
          f"ratio fdl run / torchrun = {ours / theirs:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
