"""The public API of flodld for programs built on it: the `fdl` client and anything like it.

A client imports this module (`from flodld import api`) and uses the names in `__all__`
(`api.load_config(...)`); nothing else under `flodld` is promised to it, and
`tests/test_import_contract.py` holds `clients/` to that. Every name here is re-exported from the
module that defines it, unchanged: `api.load_config is flodld.config.load_config`.

Each name loads its defining module on first use (PEP 562), so `import flodld.api` costs nothing and
a command pays only for what it touches: `fdl status` reads the configuration (pydantic, ruamel) but
never loads aiohttp (the controller) or asyncssh (the SSH fan-out), which together double its
start-up time. Type checkers read the imports under `TYPE_CHECKING`, so every name keeps its type.

Adding a name: one import under `TYPE_CHECKING` and one entry in `_EXPORTS` (the contract test checks
that the two agree and that each name is the object its module defines).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flodld.agent.envpolicy import parse_accept_env
    from flodld.agent.forkserver import HostForkServer
    from flodld.agent.heal import BurstLimit
    from flodld.agent.ranklogs import LogDirError, RankLogSpec, attempt_dir, component, prepare_log_dir
    from flodld.agent.spawn import agent_command
    from flodld.agent.spec import (
        AGENT_ENV,
        LEFT_RUN_MARK,
        SPEC_ON_STDIN,
        AgentSpec,
        DeviceError,
        encode_spec,
        parse_device_list,
        resolve_devices,
    )
    from flodld.config import (
        DEFAULT_CONTROLLER_PORT,
        ClusterBuilder,
        ClusterConfig,
        ConfigError,
        ConfigIssue,
        ConfigNotFoundError,
        LogsConfig,
        ProjectConfig,
        WalkInConfig,
        available_envs,
        load_config,
        load_text,
        parse_address,
    )
    from flodld.config.fields import LOOPBACK_HOSTS
    from flodld.config.loader import BASE_FILE, config_overlay_file, load_config_file
    from flodld.config.logs import parse_std
    from flodld.config.yamlsource import read_yaml
    from flodld.controller.options import ControllerOptions
    from flodld.controller.service import assemble_controller
    from flodld.controller.status.summary import HISTORY_COLUMNS, history_rows, member_row, summarise
    from flodld.fanout.cluster_run import run_cluster_job
    from flodld.fanout.drive import drive_run
    from flodld.fanout.forward import ForwardError, open_forward
    from flodld.fanout.remote_probe import probe_cluster
    from flodld.fanout.ssh import SshConfigError, SshEndpoint
    from flodld.fanout.sshd_recipe import JoinSshdRecipe, RecipeError
    from flodld.membership import PolicyError, derive_policy
    from flodld.membership.rootcause import root_cause_lines
    from flodld.membership.snapshot import EarlierAttempt
    from flodld.membership.supervisor import (
        AgentExited,
        ArmTimer,
        CollectAgents,
        Finish,
        Interrupted,
        RunSupervisor,
        Say,
        StartAttempt,
        StopAttempt,
        TimerExpired,
        VerdictReached,
        WorldFormed,
        keeps_links,
        verdict_event,
    )
    from flodld.membership.switch import start_credential
    from flodld.net import scaled
    from flodld.probe import HostReport, aggregate, probe_local, render
    from flodld.rank.warm import FORK_SERVER_ENV, WARM_ENV, startup_variables
    from flodld.wire.salt import OPEN_ADMISSION_KEY, SaltError, salt_from_hex

# Where each public name is defined, grouped by module (the import above is the same list).
_MODULES: dict[str, tuple[str, ...]] = {
    "flodld.agent.envpolicy": ("parse_accept_env",),
    "flodld.agent.forkserver": ("HostForkServer",),
    "flodld.agent.heal": ("BurstLimit",),
    "flodld.agent.ranklogs": ("LogDirError", "RankLogSpec", "attempt_dir", "component", "prepare_log_dir"),
    "flodld.agent.spawn": ("agent_command",),
    "flodld.agent.spec": (
        "AGENT_ENV",
        "LEFT_RUN_MARK",
        "SPEC_ON_STDIN",
        "AgentSpec",
        "DeviceError",
        "encode_spec",
        "parse_device_list",
        "resolve_devices",
    ),
    "flodld.config": (
        "DEFAULT_CONTROLLER_PORT",
        "ClusterBuilder",
        "ClusterConfig",
        "ConfigError",
        "ConfigIssue",
        "ConfigNotFoundError",
        "LogsConfig",
        "ProjectConfig",
        "WalkInConfig",
        "available_envs",
        "load_config",
        "load_text",
        "parse_address",
    ),
    "flodld.config.fields": ("LOOPBACK_HOSTS",),
    "flodld.config.logs": ("parse_std",),
    "flodld.config.loader": ("BASE_FILE", "config_overlay_file", "load_config_file"),
    "flodld.config.yamlsource": ("read_yaml",),
    "flodld.controller.options": ("ControllerOptions",),
    "flodld.controller.service": ("assemble_controller",),
    "flodld.controller.status.summary": ("HISTORY_COLUMNS", "history_rows", "member_row", "summarise"),
    "flodld.fanout.cluster_run": ("run_cluster_job",),
    "flodld.fanout.drive": ("drive_run",),
    "flodld.fanout.forward": ("ForwardError", "open_forward"),
    "flodld.fanout.remote_probe": ("probe_cluster",),
    "flodld.fanout.ssh": ("SshConfigError", "SshEndpoint"),
    "flodld.fanout.sshd_recipe": ("JoinSshdRecipe", "RecipeError"),
    "flodld.membership": ("PolicyError", "derive_policy"),
    "flodld.membership.supervisor": (
        "AgentExited",
        "ArmTimer",
        "CollectAgents",
        "Finish",
        "Interrupted",
        "RunSupervisor",
        "Say",
        "StartAttempt",
        "StopAttempt",
        "TimerExpired",
        "VerdictReached",
        "WorldFormed",
        "keeps_links",
        "verdict_event",
    ),
    "flodld.membership.rootcause": ("root_cause_lines",),
    "flodld.membership.snapshot": ("EarlierAttempt",),
    "flodld.membership.switch": ("start_credential",),
    "flodld.net": ("scaled",),
    "flodld.probe": ("HostReport", "aggregate", "probe_local", "render"),
    "flodld.rank.warm": ("FORK_SERVER_ENV", "WARM_ENV", "startup_variables"),
    "flodld.wire.salt": ("OPEN_ADMISSION_KEY", "SaltError", "salt_from_hex"),
}

_EXPORTS: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AGENT_ENV",
    "BASE_FILE",
    "DEFAULT_CONTROLLER_PORT",
    "FORK_SERVER_ENV",
    "HISTORY_COLUMNS",
    "LEFT_RUN_MARK",
    "LOOPBACK_HOSTS",
    "OPEN_ADMISSION_KEY",
    "SPEC_ON_STDIN",
    "WARM_ENV",
    "AgentExited",
    "AgentSpec",
    "ArmTimer",
    "BurstLimit",
    "ClusterBuilder",
    "ClusterConfig",
    "CollectAgents",
    "ConfigError",
    "ConfigIssue",
    "ConfigNotFoundError",
    "ControllerOptions",
    "DeviceError",
    "EarlierAttempt",
    "Finish",
    "ForwardError",
    "HostForkServer",
    "HostReport",
    "Interrupted",
    "JoinSshdRecipe",
    "LogDirError",
    "LogsConfig",
    "PolicyError",
    "ProjectConfig",
    "RankLogSpec",
    "RecipeError",
    "RunSupervisor",
    "SaltError",
    "Say",
    "SshConfigError",
    "SshEndpoint",
    "StartAttempt",
    "StopAttempt",
    "TimerExpired",
    "VerdictReached",
    "WalkInConfig",
    "WorldFormed",
    "agent_command",
    "aggregate",
    "assemble_controller",
    "attempt_dir",
    "available_envs",
    "component",
    "config_overlay_file",
    "derive_policy",
    "drive_run",
    "encode_spec",
    "history_rows",
    "keeps_links",
    "load_config",
    "load_config_file",
    "load_text",
    "member_row",
    "open_forward",
    "parse_accept_env",
    "parse_address",
    "parse_device_list",
    "parse_std",
    "prepare_log_dir",
    "probe_cluster",
    "probe_local",
    "read_yaml",
    "render",
    "resolve_devices",
    "root_cause_lines",
    "run_cluster_job",
    "salt_from_hex",
    "scaled",
    "start_credential",
    "startup_variables",
    "summarise",
    "verdict_event",
]


def __getattr__(name: str) -> object:
    """Load a public name's defining module on first use, and keep the name here from then on."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (its public names: __all__)")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
