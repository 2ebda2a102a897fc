"""flodld configuration: pydantic models of fdl.yml and its overlays, the ruamel loader, the builder."""

from __future__ import annotations

from flodld.config.builder import ClusterBuilder
from flodld.config.defaults import embedded_default
from flodld.config.devices import ALL_DEVICES, DeviceSpec, rank_labels
from flodld.config.errors import ConfigError, ConfigIssue, ConfigNotFoundError, format_key_path
from flodld.config.fields import AveragingMode, Backend, SshConfig
from flodld.config.join import JoinConfig
from flodld.config.loader import available_envs, load_config, load_text
from flodld.config.logs import LogsConfig
from flodld.config.models import (
    DEFAULT_CONTROLLER_PORT,
    ClusterConfig,
    ControllerConfig,
    ProjectConfig,
    WalkInConfig,
    WorkerConfig,
    parse_address,
)

__all__ = [
    "ALL_DEVICES",
    "DEFAULT_CONTROLLER_PORT",
    "AveragingMode",
    "Backend",
    "ClusterBuilder",
    "ClusterConfig",
    "ConfigError",
    "ConfigIssue",
    "ConfigNotFoundError",
    "ControllerConfig",
    "DeviceSpec",
    "JoinConfig",
    "LogsConfig",
    "ProjectConfig",
    "SshConfig",
    "WalkInConfig",
    "WorkerConfig",
    "available_envs",
    "embedded_default",
    "format_key_path",
    "load_config",
    "load_text",
    "parse_address",
    "rank_labels",
]
