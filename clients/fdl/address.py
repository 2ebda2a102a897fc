"""Where a thin client finds the controller: `--addr`, else the active overlay, else the project's
fdl.yml controller (when its port is fixed), else 127.0.0.1:1337.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from flodld import api


@dataclass(frozen=True)
class Candidates:
    """Addresses to try in order, and where they came from (for messages)."""

    addresses: tuple[tuple[str, int], ...]
    origin: str

    def describe(self) -> str:
        return " / ".join(format_address(host, port) for host, port in self.addresses)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_candidates(addr: str | None, env: str | None, project: Path | str, command: str) -> Candidates:
    """The resolution order of `fdl status` / `fdl start` (ValueError/ConfigError on bad input)."""
    if addr:
        return Candidates((api.parse_address(addr, api.DEFAULT_CONTROLLER_PORT),), "--addr")
    if env:
        cluster = api.load_config(project, env).cluster
        if cluster is not None:
            return _controller_candidates(cluster, f"fdl.{env}.yml controller")
    else:
        # No overlay: the project's own fdl.yml, when it names a controller with a fixed port.
        try:
            cluster = api.load_config(project, None).cluster
        except api.ConfigNotFoundError:
            cluster = None
        if cluster is not None and cluster.controller.port:
            return _controller_candidates(cluster, "fdl.yml controller")
    print(
        f"fdl {command}: no cluster env active; trying 127.0.0.1:{api.DEFAULT_CONTROLLER_PORT} "
        f"(pass --addr or use `fdl @<env> {command}` to target a specific controller)",
        file=sys.stderr,
    )
    return Candidates((("127.0.0.1", api.DEFAULT_CONTROLLER_PORT),), "convention default")


def _controller_candidates(cluster: api.ClusterConfig, origin: str) -> Candidates:
    """The configured controller, then loopback on its port (`fdl status` run on the controller host)."""
    host, port = cluster.controller.host, cluster.controller.port
    addresses = [(host, port)]
    if host not in api.LOOPBACK_HOSTS:
        addresses.append(("127.0.0.1", port))
    return Candidates(tuple(addresses), origin)


__all__ = ["Candidates", "format_address", "resolve_candidates"]
