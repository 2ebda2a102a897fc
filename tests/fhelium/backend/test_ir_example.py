"""examples/ir_allreduce.py on three spawned ranks with torchrun-style environment variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import finish_all

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "examples" / "ir_allreduce.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.multiproc
def test_example_program_decrypts_correctly_on_three_ranks() -> None:
    world, port = 3, _free_port()
    processes = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(DRIVER), "--chunk", "2"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for rank, output in enumerate(finish_all(processes, timeout=100)):
        assert f"rank {rank}/3: all_reduce_add_ciphertext decrypts to world*chunk*x" in output
        assert output.rstrip().endswith("True")
