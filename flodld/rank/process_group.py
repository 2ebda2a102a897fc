"""`init_process_group()`: torch.distributed over the controller's rendezvous, from the rank env.

Outside a flodld rank (a plain `python train.py`) it builds a world of one on a local HashStore,
so the same training code runs unchanged on a laptop.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flodld.rank.env import RankEnvironment, in_flodld_rank, read_rank_environment

DEFAULT_PG_TIMEOUT = timedelta(seconds=300)


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(env: RankEnvironment | None = None) -> torch.device:
    """The device this rank owns ('cpu', or 'cuda:0' after the agent narrowed CUDA_VISIBLE_DEVICES)."""
    if env is None:
        if not in_flodld_rank():
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        env = read_rank_environment()
    return torch.device("cuda:0" if env.device.startswith("cuda") else "cpu")


def init_process_group(backend: str | None = None, *, timeout: timedelta = DEFAULT_PG_TIMEOUT, **kwargs: Any) -> None:
    """Join the run's process group (idempotent); also opens the relay legs when the host has a relay."""
    if dist.is_initialized():
        return
    if not in_flodld_rank():
        local_store = dist.HashStore()  # type: ignore[attr-defined]  # exported at runtime, missing from the stubs
        dist.init_process_group(backend or "gloo", store=local_store, rank=0, world_size=1, timeout=timeout, **kwargs)
        return
    from flodld.rank.store import ControllerStore

    env = read_rank_environment()
    if env.device.startswith("cpu"):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    if env.relay_port is not None:
        from flodld.rank.relay_client import connect_relay

        connect_relay(env)
    store = ControllerStore(
        env.controller_host, env.controller_port, env.salt, env.run_id, rank=env.rank, timeout=timeout
    )
    chosen = backend or env.backend or default_backend(env.device)
    if chosen == "nccl":
        torch.cuda.set_device(rank_device(env))
    dist.init_process_group(
        chosen, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
    )


def close_process_group() -> None:
    """Destroy the default process group if the program left it open (a no-op otherwise).

    Left to interpreter shutdown, gloo's teardown races its peers' exits and can abort the
    process (SIGABRT) after the work is done; an explicit destroy before exit does not.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
