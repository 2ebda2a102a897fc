"""Everything a Controller needs to run, flattened from a ClusterConfig or given directly.

Tests and `fdl run` build `ControllerOptions` by hand; `flodld serve` derives them from the
cluster config with `ControllerOptions.from_cluster`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flodld.config.fields import AveragingMode, KnobSpelling
from flodld.config.join import JoinConfig
from flodld.config.models import ClusterConfig
from flodld.membership.snapshot import AttemptState, EarlierAttempt
from flodld.net.timeouts import MIN_TIMEOUT_SCALE, TIMEOUT_SCALE_ENV, TimeoutScaleError, timeout_scale

DEFAULT_PORT = 1337
LOOPBACK_BIND = "127.0.0.1"
NETWORK_BIND = "0.0.0.0"
FLAG_SPELLING = KnobSpelling(
    remove_straggler_timeout="drop --straggler-timeout",
    cadence_mode="--averaging cpu_cadence",
    growth="elastic_max_ranks",
    growth_fix="choose --averaging cpu_sync, cpu_cadence or cpu_async, or drop --elastic-max-ranks",
)


class ControllerOptions(BaseModel):
    """One run's controller settings. Times are in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    advertised_host: str = Field("127.0.0.1", description="The address workers dial (controller.host).")
    port: Annotated[int, Field(ge=0, le=65535)] = DEFAULT_PORT
    bind_host: str | None = Field(
        None, description="Listen address; default 0.0.0.0, or loopback if loopback_bind."
    )
    loopback_bind: bool = Field(
        False,
        description="Every remote worker is tunneled: listen on loopback only. Only the address actually "
        "bound decides trust: with a non-loopback bind_host this opens nothing.",
    )
    preshared: bool = Field(
        False,
        description="The launcher hands every agent the salt over its own channel (fan-out over SSH): "
        "a loopback bind does not open admission; only an explicit open_admission does.",
    )
    join: JoinConfig = Field(default_factory=JoinConfig)
    roster: tuple[str, ...] = ()
    declared_ranks: Mapping[str, int] = Field(
        default_factory=dict,
        description="Roster host -> the ranks its local_devices declare (probed for `all`): a host "
        "offering more is refused `declared_devices`.",
    )
    capacity: Annotated[int, Field(ge=0)] = 0
    tunneled_hosts: frozenset[str] = frozenset()
    averaging: AveragingMode = AveragingMode.CPU_SYNC
    backend: str = "gloo"
    fold: str = "mean"
    cadence: Annotated[int, Field(ge=1)] = 1
    env: Mapping[str, str] = Field(default_factory=dict)
    run_id: str | None = None
    restart_count: Annotated[int, Field(ge=0)] = Field(
        0, description="This attempt's number within its run (TORCHELASTIC_RESTART_COUNT for its ranks)."
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        0, description="The run's restart bound (TORCHELASTIC_MAX_RESTARTS for its ranks)."
    )
    earlier_attempts: tuple[EarlierAttempt, ...] = Field(
        (), description="The run's failed attempts before this one (state.json `attempt.earlier`)."
    )
    tolerance: Annotated[int, Field(ge=0)] = Field(0, description="Rank failures the run survives.")
    tolerance_percent: Annotated[float, Field(ge=0, le=100)] | None = Field(
        None,
        description="Rank failures the run survives as a share of the formed world (rounded down); "
        "overrides `tolerance` once the world forms.",
    )
    straggler_timeout: Annotated[float, Field(gt=0, le=86_400)] | None = Field(
        None,
        description="cpu_cadence/cpu_async: seconds after a round's first deposit before it closes without "
        "the members that have not deposited (skipped for that round only); None: every round waits.",
    )
    start_switch: bool = Field(True, description="Offer POST /start (manual/hybrid windows).")
    magic_deadline: Annotated[float, Field(gt=0)] = 5.0
    handshake_timeout: Annotated[float, Field(gt=0)] = 10.0
    link_keepalive_secs: Annotated[float, Field(gt=0)] = Field(
        15.0,
        description="TCP keepalive idle time on admitted join links (scaled); a dead link is noticed "
        "after about twice this.",
    )
    http_lifetime: Annotated[float, Field(gt=0)] = Field(
        5.0, description="Longest an HTTP connection stays open."
    )
    tick_interval: Annotated[float, Field(gt=0)] = 0.05
    max_pending_per_peer: Annotated[int, Field(ge=1)] = 64
    limit_loopback: bool = Field(
        False, description="Apply the per-address pre-admission cap to loopback too."
    )
    between_runs_secs: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="`flodld serve`: pause between a run's verdict and the next window "
        "(controller.between_runs_secs).",
    )
    history_runs: Annotated[int, Field(ge=1)] = Field(
        50,
        description="`flodld serve`: finished runs kept in state.json `history` (controller.history_runs).",
    )

    @property
    def effective_bind_host(self) -> str:
        if self.bind_host is not None:
            return self.bind_host
        return LOOPBACK_BIND if self.wants_loopback else NETWORK_BIND

    @property
    def wants_loopback(self) -> bool:
        """The configured intent (tunneled workers, tunnel_only). Trust follows the address actually
        bound (`Controller.listen`), never this alone: `bind_host` may say otherwise.
        """
        return self.loopback_bind or self.join.tunnel_only

    @property
    def timeout_scale(self) -> float:
        """FLODL_NET_TIMEOUT_SCALE as the run sees it: the run env first (what its ranks and relays read),
        then this process's environment.
        """
        raw = self.env.get(TIMEOUT_SCALE_ENV, "").strip()
        if not raw:
            return timeout_scale()
        try:
            value = float(raw)
        except ValueError:
            raise TimeoutScaleError(f"{TIMEOUT_SCALE_ENV}={raw!r} in the run env is not a number") from None
        if not math.isfinite(value) or value < MIN_TIMEOUT_SCALE:
            raise TimeoutScaleError(
                f"{TIMEOUT_SCALE_ENV}={raw!r} in the run env must be >= {MIN_TIMEOUT_SCALE}"
            )
        return value

    @model_validator(mode="after")
    def _elastic_knobs_need_their_modes(self) -> ControllerOptions:
        self.averaging.check_elastic_knobs(self.straggler_timeout, self.join.elastic_max_ranks, FLAG_SPELLING)
        return self

    @property
    def growable(self) -> bool:
        """Walk-ins may enter during training (docs/elastic-averaging.md, "Growth and healing")."""
        return self.join.elastic_max_ranks is not None and self.averaging.is_cpu

    @property
    def cpu_averaging(self) -> bool:
        return self.averaging.is_cpu

    def attempt_state(self) -> AttemptState | None:
        """This attempt among the run's restarts, for state.json and the history; None without restarts."""
        if not self.max_restarts and not self.restart_count:
            return None
        return AttemptState(
            number=self.restart_count + 1,
            max_attempts=max(self.max_restarts, self.restart_count) + 1,
            earlier=list(self.earlier_attempts),
        )

    @classmethod
    def from_cluster(
        cls, cluster: ClusterConfig, *, probed: Mapping[str, int] | None = None, **overrides: object
    ) -> ControllerOptions:
        """Flatten a validated cluster config; the bind is loopback when every remote worker is tunneled."""
        controller = cluster.controller
        remote = [w for w in cluster.workers if not w.is_local(controller.host)]
        loopback = bool(remote) and all(w.tunnel for w in remote)
        values: dict[str, object] = {
            "advertised_host": controller.host,
            "port": controller.port,
            "loopback_bind": loopback,
            "join": controller.join,
            "roster": tuple(w.host for w in cluster.workers),
            "capacity": cluster.capacity(probed),
            "declared_ranks": {
                w.host: count
                for w in cluster.workers
                if (count := w.rank_count if w.rank_count is not None else (probed or {}).get(w.host))
            },
            "tunneled_hosts": frozenset(w.host for w in cluster.workers if w.tunnel),
            "averaging": controller.averaging,
            "backend": str(controller.backend.value),
            "cadence": controller.effective_cadence,
            "env": dict(cluster.env),
            "between_runs_secs": controller.between_runs_secs,
            "history_runs": controller.history_runs,
            "tolerance": controller.tolerance_count or 0,
            "tolerance_percent": controller.tolerance_percent,
            "straggler_timeout": controller.straggler_timeout,
        }
        values.update(overrides)
        return cls.model_validate(values)
