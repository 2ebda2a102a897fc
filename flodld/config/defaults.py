"""The configuration used when a project has no fdl.yml: everything on this machine, CPU ranks."""

from __future__ import annotations

from flodld.config.builder import ClusterBuilder
from flodld.config.models import ClusterConfig


def embedded_default(ranks: int = 2) -> ClusterConfig:
    """Controller on 127.0.0.1 with port 0 (the OS picks a free one), one local worker with `ranks` CPU ranks,
    cpu_sync averaging over a gloo process group.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    return (
        ClusterBuilder()
        .controller("127.0.0.1", 0, averaging="cpu_sync", backend="gloo")
        .worker("127.0.0.1", devices=[f"cpu:{ranks}"])
        .build()
    )
