"""What `fdl run` starts on this host: the embedded default's ranks (--devices, --nproc-per-node, --ranks:
spellings of one choice) or the project's cluster: block, as a cluster config and a sentence (`plan_run`).

Pure of processes and sockets: it reads fdl.yml and, only with a GPU driver present, asks torch how many
GPUs there are. `fdl probe` sizes its check with the same options.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from flodld import api

DEFAULT_CPU_RANKS = 2


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """--devices, --nproc-per-node, --ranks: the embedded default's ranks (`fdl probe` takes them too)."""
    parser.add_argument("--devices", default=None, metavar="SPEC",
                        help="ranks of the embedded default, as `fdl join --devices`: 'all' (every GPU, the "
                             "default), '0,1', 'cuda:1', 'cpu:N'")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None,
                        metavar="N|gpu|cpu",
                        help="torchrun's spelling of the same choice: N ranks (first N GPUs, or N CPU ranks "
                             "without GPU), gpu (every GPU), cpu (one CPU rank per core)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"CPU ranks of the embedded default (default {DEFAULT_CPU_RANKS} when there is no GPU)",
    )


@dataclass(frozen=True)
class LocalRanks:
    """The ranks the embedded default starts on this host: resolved devices, one per rank."""

    devices: tuple[str, ...]  # 'cuda:I' or 'cpu:K' (K the CPU rank's ordinal), as resolve_devices gives them
    reason: str  # which flag (or the default) chose them
    cuda_count: int  # GPUs this host has

    @property
    def backend(self) -> str:
        return "nccl" if all(device.startswith("cuda:") for device in self.devices) else "gloo"

    @property
    def entries(self) -> list[str]:
        """The worker's `local_devices:` entries: its GPUs, then its CPU ranks as one 'cpu:N'."""
        cpu = sum(1 for device in self.devices if device.startswith("cpu"))
        return [device for device in self.devices if device.startswith("cuda:")] + (
            [f"cpu:{cpu}"] if cpu else []
        )

    def describe(self) -> str:
        """'2 GPU rank(s) on cuda:0, cuda:1, backend nccl (every GPU on this host)'."""
        line = f"{_describe_devices(self.devices)}, backend {self.backend} ({self.reason})"
        if self.cuda_count and not any(device.startswith("cuda:") for device in self.devices):
            line += (
                f"; this host has {self.cuda_count} GPU(s): --nproc-per-node gpu (or --devices all) "
                "runs one rank on each"
            )
        return line


def _describe_devices(devices: tuple[str, ...]) -> str:
    """'2 GPU rank(s) on cuda:0, cuda:1', '3 CPU rank(s)', or both joined by ' + '."""
    gpus = [device for device in devices if device.startswith("cuda:")]
    cpus = len(devices) - len(gpus)
    parts = ([f"{len(gpus)} GPU rank(s) on {', '.join(gpus)}"] if gpus else []) + (
        [f"{cpus} CPU rank(s)"] if cpus else []
    )
    return " + ".join(parts)


def _cpu_ranks(count: int, flag: str) -> tuple[str, ...]:
    if count < 1:
        raise ValueError(f"{flag} asks for {count} CPU ranks; ask for at least 1")
    return tuple(f"cpu:{index}" for index in range(count))


# Device nodes a GPU driver creates (NVIDIA, AMD ROCm, WSL's GPU paravirtualization). With none of them
# there is no GPU torch could use, and `fdl run` need not import torch (a second or more) to learn it.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd", "/dev/dxg")


def cuda_device_count() -> int:
    """GPUs torch can use on this host (0 for a CPU build or no driver)."""
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def choose_local_ranks(
    *,
    devices: str | None = None,
    nproc_per_node: str | None = None,
    ranks: int | None = None,
    cuda_count: int | None = None,
) -> LocalRanks:
    """Resolve --devices / --nproc-per-node / --ranks (spellings of one choice) to this host's ranks.

    None given: every GPU, else DEFAULT_CPU_RANKS CPU ranks. ValueError (exit 2) names a bad value, or
    two flags that ask for different ranks. `cuda_count` is probed through torch when None.
    """
    count = cuda_device_count() if cuda_count is None else cuda_count
    cpu_fallback = ranks if ranks is not None else DEFAULT_CPU_RANKS
    asked: list[tuple[str, tuple[str, ...]]] = []
    if devices is not None:
        flag = f"--devices {devices}"
        entries = api.parse_device_list(devices)  # the parser of `fdl join --devices`
        if [entry.lower() for entry in entries] == ["all"] and not count:
            # as for `fdl join --devices all` on a host without GPU: CPU ranks instead
            asked.append((flag, _cpu_ranks(cpu_fallback, f"--ranks {cpu_fallback}")))
        else:
            asked.append((flag, tuple(api.resolve_devices(entries, cuda_count=count))))
    if nproc_per_node is not None:
        asked.append((f"--nproc-per-node {nproc_per_node}", _nproc_devices(nproc_per_node, count)))
    if ranks is not None:
        asked.append((f"--ranks {ranks}", _cpu_ranks(ranks, f"--ranks {ranks}")))
    if not asked:
        if count:
            return LocalRanks(
                tuple(f"cuda:{index}" for index in range(count)), "every GPU on this host", count
            )
        return LocalRanks(
            _cpu_ranks(DEFAULT_CPU_RANKS, "--ranks"), "no GPU on this host; --ranks N sets the count", count
        )
    (first_flag, chosen), *others = asked
    for flag, other in others:
        if sorted(other) != sorted(chosen):  # the same ranks, whatever order they were listed in
            raise ValueError(
                f"{first_flag} asks for {_describe_devices(chosen)} but {flag} asks for "
                f"{_describe_devices(other)}; they are spellings of the same choice: "
                "give one, or make them agree"
            )
    return LocalRanks(chosen, "from " + " and ".join(flag for flag, _ in asked), count)


def _nproc_devices(value: str, cuda_count: int) -> tuple[str, ...]:
    """Torchrun's --nproc-per-node: N, gpu or cpu, as this host's devices (one rank each)."""
    word = value.strip().lower()
    if word == "gpu":
        if not cuda_count:
            raise ValueError(
                "--nproc-per-node gpu: this host has no CUDA device; use --nproc-per-node N "
                "or --ranks N for CPU ranks"
            )
        return tuple(f"cuda:{index}" for index in range(cuda_count))
    if word == "cpu":
        return _cpu_ranks(os.cpu_count() or 1, "--nproc-per-node cpu")
    try:
        count = int(word)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {value!r} is not understood; accepted: a number of ranks, "
            "'gpu' (one per GPU) or 'cpu' (one per CPU core)"
        ) from None
    if count < 1:
        raise ValueError(f"--nproc-per-node {count}: ask for at least 1 rank")
    if not cuda_count:
        return _cpu_ranks(count, f"--nproc-per-node {count}")
    if count > cuda_count:
        raise ValueError(
            f"--nproc-per-node {count}: this host has {cuda_count} CUDA device(s) and a GPU runs one "
            f"rank; ask for at most {cuda_count}, or for CPU ranks with --devices cpu:{count}"
        )
    return tuple(f"cuda:{index}" for index in range(count))


def embedded_cluster(local: LocalRanks) -> api.ClusterConfig:
    """The embedded default: controller on 127.0.0.1 (free port), one local worker with these ranks,
    cpu_sync averaging through the relay, over nccl (GPU ranks only) or gloo.
    """
    return (
        api.ClusterBuilder()
        .controller("127.0.0.1", 0, averaging="cpu_sync", backend=local.backend)
        .worker("127.0.0.1", devices=local.entries)
        .build()
    )


def project_cluster(args: argparse.Namespace) -> api.ClusterConfig | None:
    """The project's cluster block (with the selected overlay), or None for the embedded default."""
    env = getattr(args, "env", None) or os.environ.get("FDL_ENV") or None
    try:
        project = api.load_config(getattr(args, "project", "."), env)
    except api.ConfigNotFoundError:
        return None
    return project.cluster


def local_devices_counts(cluster: api.ClusterConfig, cuda_count: int | None = None) -> dict[str, int]:
    """The GPU count of every worker on this host with `local_devices: all` (what capacity needs).

    ValueError when there is such a worker and this host has no GPU: `all` offers GPUs only.
    `cuda_count` is probed through torch when None.
    """
    local = [
        host
        for host in cluster.hosts_to_probe
        if (worker := cluster.worker(host)) is not None and worker.is_local(cluster.controller.host)
    ]
    if not local:
        return {}
    count = cuda_device_count() if cuda_count is None else cuda_count
    if not count:
        raise ValueError(
            f"worker {local[0]!r} has local_devices: all, but this host has no CUDA device; "
            "list CPU ranks instead (e.g. local_devices: [cpu:2])"
        )
    return dict.fromkeys(local, count)


def plan_run(args: argparse.Namespace) -> tuple[api.ClusterConfig, str]:
    """(the cluster config `fdl run` starts, what it is: 'the embedded default: 2 CPU rank(s), ...').

    ValueError (exit 2) for bad usage: a bad or contradictory rank flag, rank flags next to a
    cluster: block, an unreadable fdl.yml.
    """
    devices, nproc, ranks = (getattr(args, name, None) for name in ("devices", "nproc_per_node", "ranks"))
    cluster = project_cluster(args)
    if cluster is not None:
        given = [
            flag
            for flag, value in (("--devices", devices), ("--nproc-per-node", nproc), ("--ranks", ranks))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} only size the embedded default; this project's fdl.yml has "
                "a cluster: block (list the ranks in its workers' local_devices)"
            )
        local = [worker for worker in cluster.workers if worker.is_local(cluster.controller.host)]
        if any(worker.host in cluster.hosts_to_probe for worker in local):
            local_devices_counts(cluster)  # raises (exit 2) before anything starts when there is no GPU
        return cluster, (
            f"the cluster: block of fdl.yml: {len(cluster.workers)} worker(s), {len(local)} on this "
            f"host, backend {cluster.controller.backend.value}"
        )
    local_ranks = choose_local_ranks(devices=devices, nproc_per_node=nproc, ranks=ranks)
    return embedded_cluster(local_ranks), f"the embedded default: {local_ranks.describe()}"
