"""flodld: a controller daemon for distributed torch runs across hosts.

The user-facing entry is `flodld.run(main)`; everything else is imported lazily so that
`import flodld` stays cheap in the agent and relay roles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run(main: Callable[[], T], *, init_process_group: bool = True) -> T:
    """Run `main` as this process's role wants: agent/relay roles run and exit here; a rank gets
    its process group initialised (unless told not to) and runs `main`. A plain process
    (`python train.py`, outside flodld) gets a world of one: a gloo group of size 1 on a local
    store, so the same collectives run unchanged.

    The process group is destroyed when `main` returns or raises, before interpreter
    shutdown, where gloo's teardown can abort a process whose peers have already left.
    No barrier: in an elastic world a rank may leave while its peers keep going.
    """
    from flodld.launcher import Role, current_role, exit_if_worker_role

    exit_if_worker_role()
    if current_role() is Role.RANK:
        from flodld.rank.env import register_stack_dump

        register_stack_dump()  # where it was, when its agent asks (a rank declared dead)
    if current_role() is not Role.RANK and not init_process_group:
        return main()  # plain and told not to: torch is not even imported
    if init_process_group:
        _init_process_group()
    from flodld.rank.process_group import close_process_group

    try:
        return main()
    finally:
        close_process_group()


def _init_process_group() -> None:
    """A flodld rank joins its run; under torchrun (MASTER_ADDR and WORLD_SIZE set) a plain process joins
    torchrun's world through env://; any other plain process becomes a world of one.
    """
    import os

    from flodld.launcher import Role, current_role
    from flodld.rank import init_process_group as init

    if current_role() is not Role.RANK and "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
        import torch
        import torch.distributed as dist

        from flodld.rank.process_group import default_backend

        if not dist.is_initialized():
            # The backend as a flodld rank picks it (nccl for a GPU rank, gloo otherwise), never torch's
            # unnamed default: gloo-only calls such as monitored_barrier then work under both launchers.
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            on_gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
            backend = default_backend("cuda" if on_gpu else "cpu")
            if backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend, init_method="env://")
        return
    init()


__all__ = ["run"]
