"""Shared field types: hosts, ports, environment maps, ssh blocks, averaging modes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StringConstraints

Host = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[^\s/]+$")]
"""A host name or IP address (no whitespace, no slashes)."""

Text = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
"""A non-empty string of reasonable size (paths, service names, arch labels)."""

Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
"""A TCP port; YAML must write it as an integer."""

Flag = Annotated[bool, Strict()]
"""A YAML boolean (`true`/`false`); strings such as "yes" are refused rather than guessed."""

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})

# Set by the launcher per rank or per host; letting `env:` override them would silently break the run.
RESERVED_ENV_KEYS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "FLODL_HOST_NAME",
        "FDL_ENV",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
RESERVED_ENV_PREFIXES = ("FLODL_INTERNAL_",)
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_env_key(key: str) -> str:
    if not _ENV_KEY_RE.match(key):
        raise ValueError(f"{key!r} is not a valid environment variable name; use letters, digits and _")
    if key in RESERVED_ENV_KEYS or key.startswith(RESERVED_ENV_PREFIXES):
        raise ValueError(f"{key} is reserved: the launcher sets it per rank, so env: cannot override it")
    return key


def _check_env_value(value: str) -> str:
    if "\x00" in value:
        raise ValueError("environment values cannot contain NUL characters")
    return value


EnvKey = Annotated[str, StringConstraints(max_length=256), AfterValidator(_check_env_key)]
EnvValue = Annotated[str, StringConstraints(max_length=65536), AfterValidator(_check_env_value)]
EnvMap = Annotated[dict[EnvKey, EnvValue], Field(max_length=4096)]
"""Environment variables for rank children; values are strings (quote numbers in YAML: "1")."""


@dataclass(frozen=True)
class KnobSpelling:
    """How one surface (the cluster config, `flodld serve`'s flags) writes the averaging knobs' fixes."""

    remove_straggler_timeout: str  # "remove straggler_timeout"
    cadence_mode: str  # "averaging: cpu_cadence"
    growth: str  # "join.elastic_max_ranks"
    growth_fix: str  # "set averaging: cpu_sync, cpu_cadence or cpu_async, or remove elastic_max_ranks"


class AveragingMode(StrEnum):
    """How ranks average parameters.

    cpu_*: rank -> per-host relay -> controller reduce (can ride an SSH tunnel).
    nccl_*: peer-to-peer all-reduce inside the NCCL process group (needs `backend: nccl`).
    """

    CPU_SYNC = "cpu_sync"
    CPU_CADENCE = "cpu_cadence"
    CPU_ASYNC = "cpu_async"
    NCCL_SYNC = "nccl_sync"
    NCCL_CADENCE = "nccl_cadence"

    @property
    def is_cpu(self) -> bool:
        return self.value.startswith("cpu_")

    @property
    def is_sync(self) -> bool:
        return self.value.endswith("_sync")

    @property
    def default_cadence(self) -> int:
        """Steps between averaging rounds when `cadence:` is not written."""
        return 1 if self.is_sync else 10

    def check_elastic_knobs(
        self, straggler_timeout: float | None, elastic_max_ranks: int | None, spelling: KnobSpelling
    ) -> None:
        """Refuse (ValueError) the elastic-averaging knobs this mode cannot honour, naming the fix as the
        caller's surface spells it: a straggler timeout outside cpu_cadence and cpu_async (a round of any
        other mode waits for every live rank), growth during training outside the CPU modes.
        """
        if straggler_timeout is not None and self not in (AveragingMode.CPU_CADENCE, AveragingMode.CPU_ASYNC):
            raise ValueError(
                f"straggler_timeout applies to cpu_cadence and cpu_async, not {self.value}: a round of any "
                f"other mode waits for every live rank ({spelling.remove_straggler_timeout}, or choose "
                f"{spelling.cadence_mode})"
            )
        if elastic_max_ranks is not None and not self.is_cpu:
            raise ValueError(
                f"{spelling.growth} (growth during training) needs a CPU averaging mode, not {self.value}: a "
                f"process group cannot take a new member mid-run ({spelling.growth_fix})"
            )

    @classmethod
    def cpu_modes(cls) -> tuple[AveragingMode, ...]:
        """The modes whose traffic all goes through the per-host relay (so a controller tunnel carries it)."""
        return tuple(mode for mode in cls if mode.is_cpu)

    @classmethod
    def cpu_modes_text(cls) -> str:
        """`cpu_sync / cpu_cadence / cpu_async`, for messages."""
        return " / ".join(mode.value for mode in cls.cpu_modes())


class Backend(StrEnum):
    """The torch.distributed process-group backend ranks initialise."""

    GLOO = "gloo"
    NCCL = "nccl"


class SshConfig(BaseModel):
    """How to reach a host over SSH; unset fields fall back to ssh's own defaults (~/.ssh/config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Host | None = None
    port: Port = 22
    user: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\s@]+$")] | None = None
    identity_file: Text | None = None
    options: tuple[
        Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\n\r]+$")], ...
    ] = ()
