"""`ClusterBuilder`: the programmatic twin of a `cluster:` block, validated by the same model and rules.

cluster = (
    ClusterBuilder()
    .controller("10.0.0.1", 1337, averaging="cpu_cadence", cadence=5)
    .join(min_rank_start=2)
    .worker("node-a", devices=[0, 1], nccl_socket_ifname="eth0", path="/srv/proj")
    .build()
)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

from pydantic import ValidationError

from flodld.config.errors import ConfigError, ConfigIssue
from flodld.config.issues import issues_from_validation
from flodld.config.models import DEFAULT_CONTROLLER_PORT, ClusterConfig


class ClusterBuilder:
    """Collects keyword arguments named exactly like the YAML keys; `build()` validates them all at once."""

    def __init__(self) -> None:
        self._controller: dict[str, Any] | None = None
        self._join: dict[str, Any] = {}
        self._workers: list[dict[str, Any]] = []
        self._env: dict[str, str] = {}

    def controller(self, host: str, port: int = DEFAULT_CONTROLLER_PORT, **settings: object) -> Self:
        """`settings`: path, averaging, backend, cadence (as in `cluster.controller`)."""
        self._controller = {"host": host, "port": port, **settings}
        return self

    def join(self, **knobs: object) -> Self:
        """`controller.join` knobs (min_rank_start, join_timeout, target_ranks, ...).

        Repeated calls add up.
        """
        self._join.update(knobs)
        return self

    def worker(
        self,
        host: str,
        devices: Sequence[int | str] | str,
        *,
        ssh: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        **settings: object,
    ) -> Self:
        """Add a worker; `devices` is `local_devices` ("all", or entries such as 0, "cuda:1", "cpu:4")."""
        entry: dict[str, Any] = {
            "host": host,
            "local_devices": devices if isinstance(devices, str) else list(devices),
        }
        if ssh is not None:
            entry["ssh"] = dict(ssh)
        if env is not None:
            entry["env"] = dict(env)
        entry.update(settings)
        self._workers.append(entry)
        return self

    def env(self, **variables: str) -> Self:
        """Cluster-scope environment for every rank child."""
        self._env.update(variables)
        return self

    def as_data(self) -> dict[str, Any]:
        """The plain `cluster:` mapping this builder describes (what a YAML file would contain)."""
        if self._controller is None:
            raise ConfigError(ConfigIssue(("controller",), "call .controller(host, port) before .build()"))
        controller = dict(self._controller)
        if self._join:
            controller["join"] = dict(self._join)
        data: dict[str, Any] = {
            "controller": controller,
            "workers": [dict(worker) for worker in self._workers],
        }
        if self._env:
            data["env"] = dict(self._env)
        return data

    def build(self) -> ClusterConfig:
        """The validated ClusterConfig; ConfigError naming each offending key path otherwise."""
        data = self.as_data()
        try:
            return ClusterConfig.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(issues_from_validation(exc, data, ClusterConfig)) from None
