"""CUDA/NCCL paths; they need GPUs and skip without them (CI with GPUs makes a skip a failure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank_harness import run_world
from rank_scenarios import SCENARIOS

from tests.conftest import require_capability

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]


def _require_gpus(count: int) -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    require_capability("gpu", found >= count, f"needs {count} CUDA device(s), found {found}")


def test_world_of_one_on_a_gpu_selects_nccl_and_the_local_device(tmp_path: Path) -> None:
    _require_gpus(1)
    run = run_world(1, "cuda", tmp_path, rendezvous="none", cuda=True)
    assert run.exit_codes == [0], run.log_tail()
    (identity,) = run.assert_ok("identity")
    assert identity["backend"] == "nccl" and identity["device"] == "cuda:0"
    run.assert_ok("cuda_values")


def test_gloo_ranks_sharing_a_gpu_receive_cuda_values_on_their_device(tmp_path: Path) -> None:
    _require_gpus(1)
    run = run_world(2, "cuda", tmp_path, cuda=True, backend="gloo", shared_gpu=True)
    assert run.exit_codes == [0, 0], run.log_tail()
    assert [d["backend"] for d in run.assert_ok("identity")] == ["gloo", "gloo"]
    run.assert_ok("cuda_values")


def test_nccl_world_runs_every_scenario_with_staged_cpu_payloads(tmp_path: Path) -> None:
    _require_gpus(2)
    run = run_world(2, "main", tmp_path, cuda=True)
    assert run.exit_codes == [0, 0], run.log_tail()
    for name, _ in SCENARIOS:
        run.assert_ok(name)
    identities = run.assert_ok("identity")
    assert [(d["backend"], d["device"]) for d in identities] == [("nccl", "cuda:0"), ("nccl", "cuda:1")]
    run2 = run_world(2, "cuda", tmp_path / "cuda", cuda=True)
    assert run2.exit_codes == [0, 0], run2.log_tail()
    run2.assert_ok("cuda_values")
