"""Rules that relate several keys of `cluster:`; pure generators yielding every violation found.

Each violation carries the key path (relative to `cluster:`) of the key the operator must change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from flodld.config.devices import spec_has_cpu
from flodld.config.errors import RuleViolation
from flodld.config.fields import AveragingMode, Backend
from flodld.config.sections import ControllerConfig, WorkerConfig

CPU_MODES_TEXT = AveragingMode.cpu_modes_text()


@dataclass(frozen=True)
class _Cluster:
    """What the rules read of a `cluster:` block (`models.ClusterConfig` runs them from its validator)."""

    controller: ControllerConfig
    workers: Sequence[WorkerConfig]

    @property
    def spans_hosts(self) -> bool:
        return len(self.workers) > 1


def cluster_violations(controller: ControllerConfig, workers: Sequence[WorkerConfig]) -> list[RuleViolation]:
    cluster = _Cluster(controller, workers)
    return [
        *_unimplemented_rules(cluster),
        *_roster_rules(cluster),
        *_averaging_rules(cluster),
        *_network_rules(cluster),
        *_tunnel_rules(cluster),
    ]


def _unimplemented_rules(cluster: _Cluster) -> Iterator[RuleViolation]:
    """Keys the schema keeps for compatibility but nothing carries out: refused rather than ignored."""
    controller = cluster.controller
    for key, value in (("docker", controller.docker), ("arch", controller.arch)):
        if value is not None:
            yield RuleViolation(
                ("controller", key),
                f"controller.{key} (a pre-flight build) is not implemented, and the run would ignore it; "
                f"remove it. workers[].{key} chooses how each worker's agent runs "
                + (
                    "(its compose service)"
                    if key == "docker"
                    else "(its Python environment, <path>/<arch>/bin/python)"
                ),
            )


def _roster_rules(cluster: _Cluster) -> Iterator[RuleViolation]:
    if not cluster.workers and not cluster.controller.join.discovery:
        yield RuleViolation(
            ("workers",),
            "must list at least one worker; a roster-free run needs controller.join.discovery: true",
        )
    first_index: dict[str, int] = {}
    for index, worker in enumerate(cluster.workers):
        if worker.host in first_index:
            yield RuleViolation(
                ("workers", index, "host"),
                f"{worker.host!r} is already workers[{first_index[worker.host]}]; each host appears once "
                "(list all its devices in one local_devices)",
            )
        else:
            first_index[worker.host] = index
        if worker.path is None and not worker.is_local(cluster.controller.host):
            yield RuleViolation(
                ("workers", index, "path"),
                f"remote worker {worker.host!r} needs path: (the project checkout directory on that host)",
            )


def _averaging_rules(cluster: _Cluster) -> Iterator[RuleViolation]:
    controller = cluster.controller
    if not controller.averaging.is_cpu and controller.backend is not Backend.NCCL:
        yield RuleViolation(
            ("controller", "averaging"),
            f"{controller.averaging.value} averages inside the NCCL process group; set backend: nccl, "
            f"or use a CPU mode ({CPU_MODES_TEXT})",
        )
    if controller.cadence is not None and controller.averaging.is_sync and controller.cadence != 1:
        yield RuleViolation(
            ("controller", "cadence"),
            f"{controller.averaging.value} averages every step, so cadence {controller.cadence} has no "
            "effect; remove cadence or choose cpu_cadence / cpu_async / nccl_cadence",
        )
    if controller.backend is Backend.NCCL:
        yield from _each_worker(
            cluster,
            "local_devices",
            lambda worker: spec_has_cpu(worker.local_devices),
            "backend: nccl needs a CUDA device per rank, but {host} lists CPU ranks; use CUDA devices or "
            "backend: gloo",
        )


def _network_rules(cluster: _Cluster) -> Iterator[RuleViolation]:
    controller = cluster.controller
    if cluster.spans_hosts and controller.backend is Backend.NCCL:
        yield from _each_worker(
            cluster,
            "nccl_socket_ifname",
            lambda worker: worker.nccl_socket_ifname is None,
            "worker {host} needs nccl_socket_ifname: (e.g. eth0) because the cluster spans several hosts "
            "and the backend is NCCL",
        )
    if controller.port == 0:
        remote = [worker.host for worker in cluster.workers if not worker.is_local(controller.host)]
        if remote or controller.join.discovery:
            who = f"remote workers ({', '.join(remote)})" if remote else "walk-in workers (discovery)"
            yield RuleViolation(
                ("controller", "port"),
                f"port 0 (pick a free port) only works when every worker runs on the controller host; "
                f"{who} must dial a fixed port 1..65535",
            )


def _tunnel_rules(cluster: _Cluster) -> Iterator[RuleViolation]:
    controller = cluster.controller
    for index, worker in enumerate(cluster.workers):
        if not worker.tunnel:
            continue
        path = ("workers", index, "tunnel")
        if worker.is_local(controller.host):
            yield RuleViolation(
                path,
                f"worker {worker.host!r} runs on the controller host: loopback already reaches the "
                "controller and there is no SSH session to carry a tunnel; remove tunnel: true",
            )
        if not controller.averaging.is_cpu:
            yield RuleViolation(
                path,
                f"tunnel: true needs a CPU averaging mode ({CPU_MODES_TEXT}), but averaging is "
                f"{controller.averaging.value}: NCCL traffic is peer-to-peer and cannot ride the tunnel",
            )
        elif controller.backend is Backend.NCCL:
            yield RuleViolation(
                path,
                "tunnel: true cannot carry an NCCL process group (its traffic is peer-to-peer); "
                "use backend: gloo or remove tunnel",
            )
    join = controller.join
    remote = [worker for worker in cluster.workers if not worker.is_local(controller.host)]
    loopback_bind = bool(remote) and all(worker.tunnel for worker in remote)
    if (
        join.discovery
        and join.token is None
        and not join.open_admission
        and not join.tunnel_only
        and not loopback_bind
    ):
        yield RuleViolation(
            ("controller", "join", "discovery"),
            "discovery: true on a network bind can never admit a walk-in: with no token the session "
            "salt is random and every hello is refused (bad_tag); set controller.join.token (32 hex, "
            "handed to walk-ins as fdl join --token / FDL_JOIN_TOKEN), or open_admission: true (anyone "
            "who reaches the port joins), or tunnel_only: true (loopback bind, walk-ins arrive through "
            "sshd)",
        )
    if join.tunnel_only:
        if not controller.averaging.is_cpu:
            yield RuleViolation(
                ("controller", "join", "tunnel_only"),
                f"tunnel_only needs a CPU averaging mode ({CPU_MODES_TEXT}); NCCL traffic cannot ride "
                "tunnels",
            )
        yield from _each_worker(
            cluster,
            "tunnel",
            lambda worker: not worker.tunnel and not worker.is_local(controller.host),
            "join.tunnel_only binds the controller to loopback, so remote worker {host} must set tunnel: "
            "true to reach it",
        )


def _each_worker(
    cluster: _Cluster, key: str, breaks: Callable[[WorkerConfig], bool], why: str
) -> Iterator[RuleViolation]:
    """A violation at `workers[i].<key>` for each worker that `breaks` the rule, in roster order; `why` is
    the sentence, its `{host}` the worker's host (quoted).
    """
    for index, worker in enumerate(cluster.workers):
        if breaks(worker):
            yield RuleViolation(("workers", index, key), why.format(host=repr(worker.host)))
