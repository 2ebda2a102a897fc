"""`init_process_group()`: torch.distributed over the controller's rendezvous, from the rank env.

Outside a flodld rank (a plain `python train.py`) it builds a world of one on a local HashStore,
so the same training code runs unchanged on a laptop.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flodld.rank.env import RankEnvironment, in_flodld_rank, read_rank_environment
from flodld.rank.relay_client import connect_relay
from flodld.rank.store import ControllerStore

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


def init_process_group(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_PG_TIMEOUT,
    **kwargs: Any,  # noqa: ANN401  torch.distributed.init_process_group's keywords, passed on
) -> None:
    """Join the run's process group (idempotent); also opens the relay legs when the host has a relay."""
    if dist.is_initialized():
        return
    if not in_flodld_rank():
        local_store = dist.HashStore()  # type: ignore[attr-defined]  # exported at runtime, missing from the stubs
        dist.init_process_group(
            backend or "gloo", store=local_store, rank=0, world_size=1, timeout=timeout, **kwargs
        )
        return
    env = read_rank_environment()
    if env.device.startswith("cpu"):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    if env.relay_port is not None:
        connect_relay(env)
    store = ControllerStore.for_rank(env, timeout=timeout)
    chosen = backend or env.backend or default_backend(env.device)
    if chosen == "nccl":
        torch.cuda.set_device(rank_device(env))
    dist.init_process_group(
        chosen, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
    )


def close_process_group() -> None:
    """Destroy the default process group if the program left it open, then wait for gloo's worker
    threads to go idle (both no-ops when there is nothing to do).

    Left to interpreter shutdown, gloo's teardown races its peers' exits and can abort the
    process (SIGABRT) after the work is done; an explicit destroy before exit does not.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    quiesce_gloo_workers()


GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def _gloo_worker_states() -> list[str] | None:
    """The scheduler state letter (R, S, D, ...) of each gloo worker thread of this process, or None
    where /proc cannot say (not Linux).
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                line = stat.read()
        except OSError:
            continue  # the thread ended between the listing and the read
        comm = line[line.find("(") + 1 : line.rfind(")")]
        if comm == GLOO_WORKER_THREAD:
            states.append(line[line.rfind(")") + 2 : line.rfind(")") + 3])
    return states


def quiesce_gloo_workers(*, limit_s: float = 2.0, interval_s: float = 0.002, calm_samples: int = 3) -> bool:
    """Wait, without the GIL, until no gloo worker thread of this process is runnable: True when they
    are all idle (or there are none), False when `limit_s` passed first.

    Why: a gloo worker frees a finished collective's work object *after* waking its waiter, and that
    free drops Python-owned tensors, which takes the GIL. If the interpreter is finalizing by then,
    CPython ends the thread with pthread_exit inside a noexcept destructor and the process aborts
    ("terminate called without an active exception") after every line of the program succeeded.
    `destroy_process_group()` joins the workers only when nothing else holds the group, and torch
    itself keeps it (modules imported after init capture `group.WORLD` in default arguments, e.g.
    torch.distributed.nn, which torch.distributed.checkpoint imports). So before the interpreter
    shuts down, flodld lets the workers finish: sleeping releases the GIL to a worker that waits for
    it, and a worker that was preempted mid-free shows as runnable until it is done.
    """
    deadline = time.monotonic() + limit_s
    calm = 0
    while calm < calm_samples:
        states = _gloo_worker_states()
        if states is None:  # no /proc: give a preempted worker a moment, the best that can be done
            time.sleep(0.05)
            return True
        if not states:
            return True
        calm = calm + 1 if all(state in "SI" for state in states) else 0
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
