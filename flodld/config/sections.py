"""The `cluster.controller` and `cluster.workers[]` sections of fdl.yml (re-exported by `models.py`).

Their own module so that `rules.py`, which relates keys across sections, reads them without importing
`models.py`, whose `ClusterConfig` validator runs the rules.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from flodld.config.devices import ALL_DEVICES, DeviceSpec, rank_labels, spec_rank_count
from flodld.config.fields import (
    LOOPBACK_HOSTS,
    AveragingMode,
    Backend,
    EnvMap,
    Flag,
    Host,
    KnobSpelling,
    SshConfig,
    Text,
)
from flodld.config.join import JoinConfig

DEFAULT_CONTROLLER_PORT = 1337
CONFIG_SPELLING = KnobSpelling(
    remove_straggler_timeout="remove straggler_timeout",
    cadence_mode="averaging: cpu_cadence",
    growth="join.elastic_max_ranks",
    growth_fix="set averaging: cpu_sync, cpu_cadence or cpu_async, or remove elastic_max_ranks",
)

ControllerPort = Annotated[int, Field(strict=True, ge=0, le=65535)]
InterfaceName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S+$")]
TolerancePercent = Annotated[str, StringConstraints(pattern=r"^(100|[0-9]{1,2})(\.[0-9]{1,3})?%$")]
"""A share of the formed world, as floDl's `max_failure`: "25%" of 8 ranks survives 2 failures."""


class ControllerConfig(BaseModel):
    """`cluster.controller`: where the controller listens and how the run averages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Host
    port: ControllerPort = DEFAULT_CONTROLLER_PORT
    path: Text | None = None
    # Not implemented (a pre-flight build): kept in the schema so that the rules refuse them by name.
    docker: Text | None = None
    arch: Text | None = None
    join: JoinConfig = Field(default_factory=JoinConfig)
    averaging: AveragingMode = AveragingMode.CPU_SYNC
    backend: Backend = Backend.GLOO
    cadence: Annotated[int, Field(strict=True, ge=1, le=1_000_000)] | None = None
    between_runs_secs: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 0.0
    """`flodld serve`: pause between one run's verdict and the next run's window."""
    history_runs: Annotated[int, Field(strict=True, ge=1, le=10_000)] = 50
    """`flodld serve`: finished runs kept in state.json `history`."""
    tolerance: Annotated[int, Field(strict=True, ge=0, le=2**31)] | TolerancePercent = 0
    """Rank failures the run survives: a count, or "N%" of the formed world (rounded down)."""
    straggler_timeout: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] | None = None
    """cpu_cadence/cpu_async: seconds after a round's first deposit before it closes without the members
    that have not deposited (skipped for that round only; docs/elastic-averaging.md). None: wait."""

    @model_validator(mode="after")
    def _elastic_knobs_need_their_modes(self) -> ControllerConfig:
        self.averaging.check_elastic_knobs(
            self.straggler_timeout, self.join.elastic_max_ranks, CONFIG_SPELLING
        )
        return self

    @property
    def tolerance_count(self) -> int | None:
        """The tolerance as a count of ranks; None when it is a share of the world."""
        return self.tolerance if isinstance(self.tolerance, int) else None

    @property
    def tolerance_percent(self) -> float | None:
        """The tolerance as a percentage of the formed world; None when it is a count."""
        return float(self.tolerance[:-1]) if isinstance(self.tolerance, str) else None

    @property
    def effective_cadence(self) -> int:
        """Steps between averaging rounds: the written `cadence`, else the mode's default."""
        return self.cadence if self.cadence is not None else self.averaging.default_cadence


class WorkerConfig(BaseModel):
    """One entry of `cluster.workers`: a host that carries ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Host
    local_devices: DeviceSpec
    ssh: SshConfig | None = None
    tunnel: Flag = False
    nccl_socket_ifname: InterfaceName | None = None
    path: Text | None = None
    arch: Text | None = None
    docker: Text | None = None
    env: EnvMap = Field(default_factory=dict)

    @property
    def rank_count(self) -> int | None:
        """Ranks this worker carries; None for `local_devices: all` (probed at dispatch)."""
        return spec_rank_count(self.local_devices)

    @property
    def ssh_target(self) -> str:
        """Where fan-out connects: `ssh.target`, else the worker's host."""
        if self.ssh is not None and self.ssh.target is not None:
            return self.ssh.target
        return self.host

    def device_labels(self) -> list[str] | None:
        """Per-rank device labels as `Hello.devices` carries them; None for "all"."""
        if self.local_devices == ALL_DEVICES:
            return None
        return rank_labels(self.local_devices)

    def rank_env(self) -> dict[str, str]:
        """What this worker's ranks get over the cluster-scope `env`: NCCL_SOCKET_IFNAME and
        GLOO_SOCKET_IFNAME from `nccl_socket_ifname`, then the worker's own `env:` (which wins).
        """
        env: dict[str, str] = {}
        if self.nccl_socket_ifname is not None:
            env["NCCL_SOCKET_IFNAME"] = self.nccl_socket_ifname
            env["GLOO_SOCKET_IFNAME"] = self.nccl_socket_ifname
        env.update(self.env)
        return env

    def is_local(self, controller_host: str) -> bool:
        """True when the worker runs on the controller's host (loopback name or the same host string)."""
        return self.host in LOOPBACK_HOSTS or self.host == controller_host
