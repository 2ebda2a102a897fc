"""init()/local_device()/shutdown() argument handling that needs no process group.

The successful paths (HashStore world of one, torchrun environment, explicit store) run in
real rank processes: see test_distributed_multirank.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fhelium.distributed as fdist

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    return monkeypatch


def test_multi_rank_world_without_rendezvous_names_what_to_set(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        fdist.init(world_size=2, rank=1)
    assert not dist.is_initialized()


def test_bad_launcher_variables_are_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' must be an integer"):
        fdist.init()
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\); got rank=3, world_size=2"):
        fdist.init()


def test_local_rank_comes_from_the_launcher(clean_env: pytest.MonkeyPatch) -> None:
    assert fdist.local_rank() == 0
    clean_env.setenv("LOCAL_RANK", "3")
    assert fdist.local_rank() == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host behaviour")
def test_cpu_host_refuses_a_cuda_device_id(clean_env: pytest.MonkeyPatch) -> None:
    assert fdist.local_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is unavailable"):
        fdist.init(device_id=torch.device("cuda", 0))


def test_shutdown_without_a_process_group_is_a_no_op(clean_env: pytest.MonkeyPatch) -> None:
    fdist.shutdown()
    assert not dist.is_initialized()


def test_facade_reexports_torch_distributed_unchanged() -> None:
    for name in ("all_reduce", "broadcast", "new_group", "batch_isend_irecv", "ReduceOp", "Work", "P2POp"):
        assert getattr(fdist, name) is getattr(dist, name)
    assert fdist.all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert set(fdist.__all__) <= set(dir(fdist))
