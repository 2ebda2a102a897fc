"""examples/ir_allreduce.py on three spawned ranks with torchrun-style environment variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.rank_zygote import Zygote

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "examples" / "ir_allreduce.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# what examples/ir_allreduce.py imports, loaded once in the zygote its ranks are forked from
PRELOAD = [
    "fhelium.distributed", "flodld", "fhelium.backend", "fhelium.backend.distributed", "fhelium.compile",
    "fhelium.compile.passes", "fhelium.engine", "fhelium.ir", "fhelium.native.build:load",
]  # fmt: skip


@pytest.mark.multiproc
def test_example_program_decrypts_correctly_on_three_ranks(tmp_path: Path) -> None:
    world, port = 3, _free_port()
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    zygote = Zygote(PRELOAD, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    try:
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
                "PYTHONPATH": pythonpath,
            }
            processes.append(zygote.spawn(DRIVER, ["--chunk", "2"], env, tmp_path / f"rank{rank}.log"))
        for rank, process in enumerate(processes):
            assert process.wait(timeout=100) == 0, f"rank {rank} failed:\n{process.output}"
        for rank, process in enumerate(processes):
            output = process.output
            assert f"rank {rank}/3: all_reduce_add_ciphertext decrypts to world*chunk*x" in output
            assert output.rstrip().endswith("True")
    finally:
        zygote.close()
