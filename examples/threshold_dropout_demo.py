"""t-out-of-N encrypted averaging that survives a rank being killed: 3 ranks, threshold 2, rank 2 SIGKILLed.

    python examples/threshold_dropout_demo.py                 # 3 ranks, threshold 2, rank 2 killed
    python examples/threshold_dropout_demo.py --ranks 5 --threshold 3 --kill 1

Starts the ranks of examples/threshold_aggregation.py as local processes on 127.0.0.1 (a gloo world,
as torchrun would; this launcher hosts the rendezvous store, so that any rank may die without taking
the store with it) with ``--threshold T --kill-after-encrypting R``: the keys are t-out-of-N, rank R
kills itself with SIGKILL in the first step right after its encrypted gradient is in the checked sum,
and the survivors decrypt that step's mean (which still covers rank R's input) and go on without it.
Every survivor prints the mean and whose inputs it covers. Exit code 0 when every survivor passed.

(Under ``fdl run`` a rank that dies by a signal tears its host down, by design: on one host that is
every rank. Across hosts the survivors on other hosts finish as here; see docs/fhelium-multiparty.md.)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

EXAMPLE = Path(__file__).with_name("threshold_aggregation.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=2)
    parser.add_argument("--kill", type=int, default=2, help="the rank killed after encrypting")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--share-timeout", type=float, default=10.0)
    args = parser.parse_args()
    if not 0 <= args.kill < args.ranks or not 1 <= args.threshold <= args.ranks - 1:
        parser.error("need 0 <= --kill < --ranks and 1 <= --threshold <= --ranks - 1")

    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, args.ranks, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    ranks = []
    for rank in range(args.ranks):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        command = [
            sys.executable, str(EXAMPLE), "--transport", "process-group", "--keys", "threshold",
            "--threshold", str(args.threshold), "--steps", str(args.steps),
            "--kill-after-encrypting", str(args.kill), "--share-timeout", str(args.share_timeout),
        ]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))

    def pump(rank: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"[r{rank}] {line.rstrip()}", flush=True)

    pumps = [threading.Thread(target=pump, args=(rank, p), daemon=True) for rank, p in enumerate(ranks)]
    for thread in pumps:
        thread.start()
    codes = []
    for process in ranks:
        try:
            codes.append(process.wait(timeout=600))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    for thread in pumps:
        thread.join(timeout=5)
    del store
    killed = codes[args.kill] == -signal.SIGKILL
    survivors_ok = all(code == 0 for rank, code in enumerate(codes) if rank != args.kill)
    fate = "was SIGKILLed" if killed else f"exited {codes[args.kill]}"
    verdict = "PASS" if survivors_ok else "FAIL"
    print(f"threshold_dropout_demo: rank {args.kill} {fate}; survivors {verdict} (exit codes {codes})")
    return 0 if killed and survivors_ok else 1


if __name__ == "__main__":
    sys.exit(main())
