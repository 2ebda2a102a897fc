"""A stock torchrun-style script for the kept-link restarts (tests/e2e/test_serve_restarts.py and
test_restarts.py; no flodld import). Arguments: OUT_DIR HOST (PROBE_HOST in the environment wins). Every
rank appends `restart rank world agent_pid host` to OUT_DIR/attempts.txt once its process group formed
(`agent_pid`: the agent that supervises it, so a host kept linked across a restart shows the same one
twice: its parent, or, for a rank a fork server forked, the process reading its stdout). On the
first attempt (TORCHELASTIC_RESTART_COUNT=0) the ranks all-reduce every 0.2 s for two minutes, a run
long enough to lose a host in; on a later attempt they all-reduce three times and end.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def agent_pid() -> int:
    """The agent: this rank's parent, unless a fork server forked it; then whoever reads its stdout pipe."""
    parent = os.getppid()
    if b"--fork-server" not in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0"):
        return parent
    pipe = os.readlink("/proc/self/fd/1")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == pipe for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    raise RuntimeError(f"no process reads this rank's stdout ({pipe})")


def main() -> None:
    out = Path(sys.argv[1])
    host = os.environ.get("PROBE_HOST") or sys.argv[2]  # fdl run's workers name theirs in their env
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(out / "attempts.txt", "a") as log:
        log.write(f"{restart} {rank} {world} {agent_pid()} {host}\n")
    for _ in range(600 if restart == 0 else 3):
        time.sleep(0.2)
        dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
