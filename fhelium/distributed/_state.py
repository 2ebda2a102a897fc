"""Process-group initialisation and the rank-local device.

``init`` is a thin wrapper over ``torch.distributed.init_process_group`` that fills in the
identity a launcher provides (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, or a store
handed over by a flodld rank) and picks the backend and device: NCCL on ``cuda:LOCAL_RANK``
when CUDA exists, Gloo on CPU otherwise. A world of one without any rendezvous still gets a
real ProcessGroup, backed by an in-process ``HashStore``.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed re-exports both from torch._C without `as`, so strict mypy (no implicit re-export)
# does not see them; they are the public names all the same.
from torch.distributed import HashStore, Store  # type: ignore[attr-defined]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def local_rank() -> int:
    """The launcher's per-host rank (``LOCAL_RANK``, default 0); selects the CUDA device."""
    return _env_int("LOCAL_RANK", 0)


def local_device() -> torch.device:
    """The device this rank computes and receives on: its current CUDA device, else CPU.

    Independent of the process group, so it is usable before ``init``.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _select_device(device_id: torch.device | int | None) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank()) if device_id is None else torch.device(device_id)
        if device.type != "cuda":
            raise ValueError(
                f"CUDA is available, so init(device_id=...) must name a CUDA device; got {device}"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        return device
    if device_id is not None and torch.device(device_id).type != "cpu":
        raise ValueError(
            f"CUDA is unavailable on this host, so init(device_id=...) must be CPU or None; got {device_id}"
        )
    return torch.device("cpu")


def init(
    *,
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    store: Store | None = None,
    pg_options: object | None = None,
    device_id: torch.device | int | None = None,
) -> None:
    """Create the default process group (no-op if one exists; the device is still selected).

    Identity comes from the arguments, else ``RANK``/``WORLD_SIZE`` (defaults 0 and 1).
    Rendezvous: ``store`` if given (e.g. a flodld ``ControllerStore``), else ``init_method``,
    else a local ``HashStore`` for a world of one, else torch's ``env://``.
    """
    device = _select_device(device_id)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if dist.is_initialized():
        return
    chosen_backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    chosen_rank = _env_int("RANK", 0) if rank is None else rank
    chosen_world = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    if not 0 <= chosen_rank < chosen_world:
        raise ValueError(
            f"rank must be in [0, world_size); got rank={chosen_rank}, world_size={chosen_world} "
            "(set RANK/WORLD_SIZE or pass rank= and world_size=)"
        )
    kwargs: dict[str, Any] = {"backend": chosen_backend, "rank": chosen_rank, "world_size": chosen_world}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if pg_options is not None:
        kwargs["pg_options"] = pg_options
    if chosen_backend == "nccl" and device.type == "cuda":
        kwargs["device_id"] = device
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    elif chosen_world == 1:
        kwargs["store"] = HashStore()
    else:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ValueError(
                f"world_size={chosen_world} needs a rendezvous: pass store= or init_method=, "
                f"or set {' and '.join(missing)} (torchrun does this)"
            )
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    if chosen_backend == "gloo":
        # Left to interpreter shutdown, gloo's teardown races the peers' exits and can abort
        # the process after its work is done; destroying the group first does not.
        atexit.register(shutdown)


def shutdown(group: dist.ProcessGroup | None = None) -> None:
    """Destroy ``group`` (default: every group); a no-op when nothing is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)
