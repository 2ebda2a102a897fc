"""A stock torchrun-style training script that checkpoints and resumes (no flodld import).

Deterministic: every rank's gradient is a function of the parameters, its rank and the step, and the
average is a gloo all-reduce, so a run that resumes from a checkpoint ends with the same parameters,
bit for bit, as one that never failed. Arguments: OUT_DIR STEPS EVERY [FAULT_STEP FAULT_RANK]: rank
0 saves {step, w} every EVERY steps to OUT_DIR/ckpt.pt (atomically); on the first attempt
(TORCHELASTIC_RESTART_COUNT=0; on every attempt with a sixth argument `always`) rank FAULT_RANK
SIGKILLs itself at step FAULT_STEP. Rank 0 writes the
final parameters to OUT_DIR/final.pt; every rank appends `rank restart_count start_step warm` to
OUT_DIR/attempts.txt when it starts (`warm` 1 when the process started as a warm rank of flodld,
`python -m flodld.launcher.rank --warm`, that loaded torch before its world formed; 2 when a fork server,
`python -m flodld.launcher.rank --fork-server FD`, forked it with torch loaded; 0 a cold start). With
CKPT_STEP_SECONDS set, every step sleeps that long first (a run long enough to lose a host in).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def gradient(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    data = torch.arange(1, w.numel() + 1, dtype=torch.float64) * (rank + 1) * 0.01 * step
    return 0.1 * w + data - 0.05 * torch.sin(w * (rank + 2))


def main() -> None:
    out, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fault_step, fault_rank = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (-1, -1)
    always = sys.argv[6:7] == ["always"]  # the fault on every attempt, not only the first
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = out / "ckpt.pt"
    w = torch.ones(8, dtype=torch.float64)
    start = 1
    if ckpt.exists():
        saved = torch.load(ckpt)
        w, start = saved["w"], saved["step"] + 1
    with open(out / "attempts.txt", "a") as log:
        warm = 1 if "--warm" in sys.orig_argv else 2 if "--fork-server" in sys.orig_argv else 0
        log.write(f"{rank} {restart} {start} {warm}\n")
    pause = float(os.environ.get("CKPT_STEP_SECONDS", "0"))
    for step in range(start, steps + 1):
        if pause:
            time.sleep(pause)
        if (restart == 0 or always) and rank == fault_rank and step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
        g = gradient(w, rank, step)
        dist.all_reduce(g)
        w = w - 0.1 * g / world
        if rank == 0 and step % every == 0:
            tmp = out / f"ckpt.{os.getpid()}.tmp"
            torch.save({"step": step, "w": w}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
    if rank == 0:
        torch.save(w, out / "final.pt")
    print(f"checkpoint_resume rank={rank} restart={restart} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
