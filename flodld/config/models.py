"""pydantic models of fdl.yml (and its overlays): the `cluster:` deployment and the walk-in `join:` block.

Every model forbids unknown keys. Rules that relate several keys live in `rules.py` and run from the
`ClusterConfig` validator, so YAML and `ClusterBuilder` produce and check the same model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from flodld.config.devices import ALL_DEVICES, DeviceSpec
from flodld.config.errors import RuleViolation, RuleViolations
from flodld.config.fields import (
    EnvMap,
    Flag,
    Host,
    SshConfig,
    Text,
)
from flodld.config.logs import LogsConfig
from flodld.config.rules import cluster_violations
from flodld.config.sections import DEFAULT_CONTROLLER_PORT as DEFAULT_CONTROLLER_PORT  # re-exported
from flodld.config.sections import ControllerConfig as ControllerConfig  # re-exported
from flodld.config.sections import WorkerConfig as WorkerConfig  # re-exported
from flodld.wire.salt import SaltHex


class ClusterConfig(BaseModel):
    """`cluster:`: the controller, the roster of workers and cluster-scope environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    controller: ControllerConfig
    workers: tuple[WorkerConfig, ...] = ()
    env: EnvMap = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_rules(self) -> ClusterConfig:
        violations = cluster_violations(self.controller, self.workers)
        if violations:
            raise RuleViolations(violations)
        return self

    @property
    def spans_hosts(self) -> bool:
        """More than one worker host (walk-ins may add more at run time)."""
        return len(self.workers) > 1

    @property
    def explicit_capacity(self) -> int:
        """Ranks from explicit device lists; workers with "all" add theirs only once probed."""
        return sum(worker.rank_count or 0 for worker in self.workers)

    @property
    def hosts_to_probe(self) -> tuple[str, ...]:
        """Workers whose `local_devices: all` must be counted at dispatch."""
        return tuple(worker.host for worker in self.workers if worker.rank_count is None)

    def capacity(self, probed: Mapping[str, int] | None = None) -> int:
        """Total configured ranks; `probed` gives the device count of every "all" worker (by host)."""
        probed = probed or {}
        missing = [host for host in self.hosts_to_probe if host not in probed]
        if missing:
            raise ValueError(
                f"capacity needs the probed device count of {', '.join(missing)} (local_devices: all); "
                "probe those hosts first or list their devices explicitly"
            )
        return self.explicit_capacity + sum(probed[host] for host in self.hosts_to_probe)

    def worker(self, host: str) -> WorkerConfig | None:
        return next((worker for worker in self.workers if worker.host == host), None)


def parse_address(text: str, default_port: int = DEFAULT_CONTROLLER_PORT) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]` or `[v6]:port` -> (host, port); ValueError with the accepted forms."""
    help_text = 'write "host", "host:port" or "[ipv6]:port"'
    raw = text.strip()
    if raw.startswith("["):
        close = raw.find("]")
        if close < 0:
            raise ValueError(f"{text!r} opens '[' without ']'; {help_text}")
        host, rest = raw[1:close], raw[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r} has {rest!r} after the bracketed address; {help_text}")
        port_text = rest[1:] if rest else ""
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
    else:
        host, port_text = raw, ""
    if not host or any(char.isspace() or char == "/" for char in host):
        raise ValueError(f"{text!r} has no usable host; {help_text}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r} has port {port_text!r}; ports are integers 1..65535")
    return host, int(port_text)


class WalkInConfig(BaseModel):
    """Top-level `join:`: defaults for `fdl join` on a worker box (flags on the command line win)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: Annotated[str, StringConstraints(min_length=1, max_length=300)] | None = None
    ssh: SshConfig | None = None
    token: SaltHex | None = None
    # `bin:` is the golden-image recipe's spelling (and `fdl join --bin`'s); both are accepted.
    program: Text | None = Field(default=None, validation_alias=AliasChoices("program", "bin"))
    args: tuple[Annotated[str, StringConstraints(max_length=65536)], ...] = ()
    host: Host | None = None
    devices: DeviceSpec = ALL_DEVICES
    persist: Flag = False
    # With persist: ranks forked from a server that loaded torch once (docs/elastic-averaging.md).
    fork_server: Flag = True
    # Controller env names this walk-in applies beyond the safe set (flodld.agent.envpolicy).
    accept_env: tuple[
        Annotated[str, StringConstraints(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], ...
    ] = ()

    @model_validator(mode="before")
    @classmethod
    def _bin_is_program(cls, data: object) -> object:
        """`bin:` is an alias of `program:` (below); both at once would leave one silently unused."""
        if isinstance(data, Mapping) and "bin" in data and "program" in data:
            raise RuleViolations(
                [RuleViolation(("bin",), "join.bin and join.program name the same thing; keep one of them")]
            )
        return data

    @field_validator("address")
    @classmethod
    def _address_parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value

    @model_validator(mode="after")
    def _ssh_needs_target(self) -> WalkInConfig:
        if self.ssh is not None and self.ssh.target is None:
            raise RuleViolations(
                [
                    RuleViolation(
                        ("ssh", "target"), "join.ssh needs a target: (the host the tunnel goes through)"
                    )
                ]
            )
        return self

    def controller_endpoint(self) -> tuple[str, int]:
        """The controller to dial (as seen from the ssh host when `ssh` is set); default 127.0.0.1:1337."""
        return (
            parse_address(self.address)
            if self.address is not None
            else ("127.0.0.1", DEFAULT_CONTROLLER_PORT)
        )


class ProjectConfig(BaseModel):
    """A whole fdl.yml (after overlays): every block is optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: ClusterConfig | None = None
    join: WalkInConfig | None = None
    logs: LogsConfig | None = None
