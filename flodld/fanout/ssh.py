"""SSH connections for fan-out and walk-ins (asyncssh), with OpenSSH-style options.

The launcher opens one session per worker, starts the agent under a small bash supervisor
that (a) reads secret environment from stdin, never argv, (b) runs the agent in its own
process group, and (c) tears that group down (TERM, then KILL after a grace period) when the
session ends for any reason: launcher exit, Ctrl-C, a dead network (keepalives), SIGTERM.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

KEEPALIVE_INTERVAL_S = 10.0
KEEPALIVE_COUNT_MAX = 3
SUPPORTED_OPTIONS = (
    "ProxyJump", "StrictHostKeyChecking", "UserKnownHostsFile", "ServerAliveInterval",
    "ServerAliveCountMax", "ConnectTimeout", "BatchMode", "IdentitiesOnly",
)  # fmt: skip


class SshConfigError(ValueError):
    """An ssh target or option cannot be honoured; the message names it and what is allowed."""


@dataclass(frozen=True)
class SshEndpoint:
    """Where and how to reach one host: the `ssh:` block of a worker or `fdl join --ssh`."""

    host: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()
    parsed: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.host:
            raise SshConfigError("ssh target is empty; write [user@]host[:port]")
        if not 1 <= self.port <= 65535:
            raise SshConfigError(f"ssh port must be in 1..65535, got {self.port}")
        _not_an_option(self.host, "ssh host")
        if self.user is not None:
            _not_an_option(self.user, "ssh user")
        for option in self.options:
            key, sep, value = option.partition("=")
            if not sep:
                key, _, value = option.partition(" ")
            key, value = key.strip(), value.strip()
            match = next((known for known in SUPPORTED_OPTIONS if known.lower() == key.lower()), None)
            if match is None:
                raise SshConfigError(
                    f"unsupported ssh option {key!r} in {option!r}; supported: {', '.join(SUPPORTED_OPTIONS)}"
                )
            if not value:
                raise SshConfigError(f"ssh option {match} needs a value, e.g. {match}=...")
            if match == "ProxyJump":
                for hop in value.split(","):
                    _not_an_option(hop.strip().rpartition("@")[2], "ProxyJump host")
                    _not_an_option(hop.strip(), "ProxyJump hop")
            self.parsed[match] = value
        strict = self.parsed.get("StrictHostKeyChecking", "yes").lower()
        if strict not in ("yes", "no", "accept-new"):
            raise SshConfigError(f"StrictHostKeyChecking must be yes, no or accept-new, got {strict!r}")

    @classmethod
    def parse(cls, target: str, **kwargs: Any) -> SshEndpoint:  # noqa: ANN401  SshEndpoint's other fields, passed on
        """`[user@]host[:port]`, with IPv6 literals in brackets: `user@[fe80::1]:2222`."""
        user, _, rest = target.rpartition("@")
        port = kwargs.pop("port", 22)
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            if tail.startswith(":"):
                port = _port(tail[1:], target)
        elif rest.count(":") == 1:
            host, _, port_text = rest.partition(":")
            port = _port(port_text, target)
        else:
            host = rest
        return cls(host=host, port=port, user=user or kwargs.pop("user", None), **kwargs)

    @property
    def label(self) -> str:
        who = f"{self.user}@" if self.user else ""
        return f"{who}{self.host}:{self.port}"


def _not_an_option(value: str, what: str) -> None:
    """Refuse a name that ssh would read as a command-line option (`-oProxyCommand=...` runs a command)."""
    if value.startswith("-") or any(ord(char) < 32 for char in value):
        raise SshConfigError(
            f"{what} {value!r} starts with '-' or holds a control character; ssh would read it "
            "as an option — write a host name or address"
        )


def _port(text: str, target: str) -> int:
    if not text.isdigit():
        raise SshConfigError(f"bad port {text!r} in ssh target {target!r}; write [user@]host[:port]")
    return int(text)


def _known_hosts_path(endpoint: SshEndpoint) -> Path:
    return Path(endpoint.parsed.get("UserKnownHostsFile", "~/.ssh/known_hosts")).expanduser()


async def connect(endpoint: SshEndpoint, *, timeout: float = 30.0) -> asyncssh.SSHClientConnection:
    """Open a session: public keys only (never a password prompt), keepalives on, jumps honoured."""
    tunnel: asyncssh.SSHClientConnection | None = None
    jump = endpoint.parsed.get("ProxyJump")
    if jump and jump.lower() != "none":
        hops = [h.strip() for h in jump.split(",") if h.strip()]
        for hop in hops:
            hop_endpoint = SshEndpoint.parse(hop, identity_file=endpoint.identity_file,
                                             options=_inherited_options(endpoint))  # fmt: skip
            tunnel = await _connect_one(hop_endpoint, tunnel, timeout)
    return await _connect_one(endpoint, tunnel, timeout)


def _inherited_options(endpoint: SshEndpoint) -> tuple[str, ...]:
    keep = ("StrictHostKeyChecking", "UserKnownHostsFile", "ConnectTimeout")
    return tuple(f"{k}={v}" for k, v in endpoint.parsed.items() if k in keep)


async def _connect_one(
    endpoint: SshEndpoint, tunnel: asyncssh.SSHClientConnection | None, timeout: float
) -> asyncssh.SSHClientConnection:
    strict = endpoint.parsed.get("StrictHostKeyChecking", "yes").lower()
    known_hosts_file = _known_hosts_path(endpoint)
    known_hosts: Any = str(known_hosts_file) if known_hosts_file.exists() else ()
    first_contact = False
    if strict == "no":
        known_hosts = None
    elif strict == "accept-new":
        known_hosts, first_contact = _accept_new_known_hosts(endpoint, known_hosts_file)
    interval = float(endpoint.parsed.get("ServerAliveInterval", KEEPALIVE_INTERVAL_S))
    count = int(endpoint.parsed.get("ServerAliveCountMax", KEEPALIVE_COUNT_MAX))
    options: dict[str, Any] = {
        "port": endpoint.port, "known_hosts": known_hosts, "keepalive_interval": interval,
        "keepalive_count_max": count, "password": None, "kbdint_auth": False,
        "connect_timeout": float(endpoint.parsed.get("ConnectTimeout", timeout)),
    }  # fmt: skip
    if endpoint.user:
        options["username"] = endpoint.user
    if endpoint.identity_file:
        # expanduser reads $HOME (or the password database once): no file I/O to move off the loop
        options["client_keys"] = [str(Path(endpoint.identity_file).expanduser())]  # noqa: ASYNC240
    if tunnel is not None:
        options["tunnel"] = tunnel
    if first_contact:
        options["client_factory"] = _FirstContact
    try:
        conn = await asyncssh.connect(endpoint.host, **options)
    except (OSError, asyncssh.Error) as exc:
        raise ConnectionError(f"ssh {endpoint.label}: {exc}") from exc
    if first_contact:
        key = conn.get_server_host_key()
        if key is not None:
            known_hosts_file.parent.mkdir(parents=True, exist_ok=True)
            host = endpoint.host if endpoint.port == 22 else f"[{endpoint.host}]:{endpoint.port}"
            with known_hosts_file.open("a") as handle:
                handle.write(f"{host} {key.export_public_key().decode().strip()}\n")
    return conn


class _FirstContact(asyncssh.SSHClient):
    """accept-new for a host with no trusted entry: any key that is not @revoked (asyncssh checks
    revocation before it asks this), the way OpenSSH's accept-new takes a new host's key.
    """

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        return True


def _accept_new_known_hosts(endpoint: SshEndpoint, path: Path) -> tuple[Any, bool]:
    """What `known_hosts` asyncssh gets under accept-new, and whether this is a first contact.

    A host is known when known_hosts trusts anything for it: a host key, or a `@cert-authority`
    (or X.509) entry whose pattern matches it; it is then checked strictly, exactly as under `yes`
    (a plain key that the CA did not sign is refused, not accepted as new). Otherwise it is a first
    contact: a key is accepted and remembered, but the `@revoked` keys still apply and are refused.
    """
    if not path.exists():
        return ([], [], []), True
    try:
        known = asyncssh.read_known_hosts(str(path))
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"ssh {endpoint.label}: cannot read known_hosts {path}: {exc}") from exc
    port = None if endpoint.port == 22 else endpoint.port
    host_keys, ca_keys, revoked, x509_certs, _, x509_subjects, _ = known.match(endpoint.host, "", port)
    if host_keys or ca_keys or x509_certs or x509_subjects:
        return str(path), False
    # With nothing trusted for [host]:port, match() answers for the bare host instead, dropping the
    # revocations written for [host]:port: collect those too.
    revoked = list(revoked) + (list(known.match(f"[{endpoint.host}]:{port}", "", None)[2]) if port else [])
    return ([], [], revoked), True


# Runs on the remote host. Secret environment arrives on stdin as KEY=VALUE lines ended by an
# empty line; the agent runs in its own session so the whole tree can be signalled; stdin EOF
# (the launcher or its session is gone) or HUP/TERM/INT tears the group down. The stdin watcher
# tears the group down itself rather than signalling this shell: a signal ignored when bash started
# (HUP under nohup, say) cannot be trapped, and the tree would outlive its launcher.
SUPERVISOR = r"""
set -u
while IFS= read -r kv && [ -n "$kv" ]; do export "$kv"; done
grace="$1"; workdir="$2"; shift 2
cd "$workdir" || { echo "fdl: cannot cd to $workdir on $(hostname)" >&2; exit 2; }
setsid "$@" </dev/null &
child=$!
stop_group() {
  kill -TERM -- "-$child" 2>/dev/null
  end=$(( $(date +%s) + grace ))
  while kill -0 -- "-$child" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.1; done
  kill -KILL -- "-$child" 2>/dev/null
}
stop() {
  trap - HUP TERM INT
  stop_group
  exit 143
}
trap stop HUP TERM INT
exec 3<&0
( while IFS= read -r -u 3 _; do :; done; stop_group ) >/dev/null 2>&1 &
watcher=$!
wait "$child"
code=$?
kill "$watcher" 2>/dev/null
exit "$code"
"""


def supervised_command(workdir: str, argv: Sequence[str], *, grace_s: int = 10) -> str:
    """The remote command line: bash running SUPERVISOR; no secret appears in it."""
    return " ".join(
        ["exec", "bash", "-c", shlex.quote(SUPERVISOR), "fdl-agent", str(grace_s), shlex.quote(workdir)]
        + [shlex.quote(a) for a in argv]
    )


def secret_env_block(env: Mapping[str, str]) -> str:
    for key, value in env.items():
        if not key.isidentifier() or "\n" in value:
            raise SshConfigError(f"environment entry {key!r} cannot be sent over stdin (newline or bad name)")
    return "".join(f"{k}={v}\n" for k, v in env.items()) + "\n"


@dataclass
class RemoteAgent:
    """One supervised remote process; `stop()` is idempotent and never raises."""

    endpoint: SshEndpoint
    conn: asyncssh.SSHClientConnection
    process: asyncssh.SSHClientProcess[str]
    output_task: asyncio.Task[None] | None = None
    forwarded_port: int | None = None
    lost: bool = False

    async def wait(self) -> int:
        """The remote exit status; 255 (like ssh) when the session ended without one (`lost`)."""
        try:
            completed = await self.process.wait(check=False)
        except (OSError, asyncssh.Error):
            self.lost = True
            return 255
        if self.output_task is not None:  # the last lines first; a cancelled wait leaves the pump running
            await asyncio.wait({self.output_task})
            if not self.output_task.cancelled():
                self.output_task.exception()  # a session cut mid-line ends the pump with an error: seen, moot
        code = completed.exit_status
        if code is None and not completed.exit_signal:
            self.lost = True  # no status, no signal: the connection died (keepalives) or was cut
        return int(code) if code is not None else (128 + 1 if completed.exit_signal else 255)

    async def stop(self, *, timeout: float = 15.0) -> None:
        try:
            self.process.stdin.write_eof()
        except (OSError, asyncssh.Error, BrokenPipeError):
            pass
        try:
            await asyncio.wait_for(self.process.wait(check=False), timeout)
        except (TimeoutError, asyncssh.Error, OSError):
            pass
        self.conn.close()
        try:
            await asyncio.wait_for(self.conn.wait_closed(), 5)
        except (TimeoutError, asyncssh.Error, OSError):
            pass


async def start_remote_agent(
    endpoint: SshEndpoint,
    *,
    workdir: str,
    argv: Sequence[str],
    secret_env: Mapping[str, str] | Callable[[int | None], Mapping[str, str]],
    remote_forward: tuple[int, int] | None = None,
    on_output: Callable[[str, str], None] | None = None,
    grace_s: int = 10,
) -> RemoteAgent:
    """Connect, optionally add a remote forward, start the supervised agent.

    `remote_forward=(listen, target)` is `-R 127.0.0.1:listen:127.0.0.1:target`: the worker's
    loopback `listen` port reaches the launcher's loopback `target` port through this session.
    `listen=0` lets the remote sshd pick a free port; a callable `secret_env` receives the port
    actually forwarded (None without a forward), so the agent's spec can name it.
    """
    conn = await connect(endpoint)
    forwarded: int | None = None
    try:
        if remote_forward is not None:
            listen, target = remote_forward
            try:
                listener = await conn.forward_remote_port("127.0.0.1", listen, "127.0.0.1", target)
            except (OSError, asyncssh.Error) as exc:
                raise ConnectionError(
                    f"ssh {endpoint.label}: remote forward 127.0.0.1:{listen} -> 127.0.0.1:{target} refused "
                    f"({exc}); the worker's sshd must allow TCP forwarding (AllowTcpForwarding yes/remote)"
                ) from exc
            forwarded = listener.get_port()
        env = secret_env(forwarded) if callable(secret_env) else secret_env
        process = await conn.create_process(supervised_command(workdir, argv, grace_s=grace_s),
                                            stderr=asyncssh.STDOUT)  # fmt: skip
        process.stdin.write(secret_env_block(env))
    except BaseException:
        conn.close()
        raise
    agent = RemoteAgent(endpoint, conn, process, forwarded_port=forwarded)
    agent.output_task = asyncio.create_task(_pump(process, endpoint, on_output))
    return agent


async def _pump(
    process: asyncssh.SSHClientProcess[str],
    endpoint: SshEndpoint,
    on_output: Callable[[str, str], None] | None,
) -> None:
    async for line in process.stdout:
        if not line:  # end of stream, not an empty line (those still carry "\n")
            break
        if on_output is not None:
            on_output(endpoint.host, line.rstrip("\n"))


async def run_remote(endpoint: SshEndpoint, command: str, *, timeout: float = 60.0) -> tuple[int, str, str]:
    """Run one short command (probe, device discovery); returns (exit code, stdout, stderr)."""
    conn = await connect(endpoint)
    try:
        result = await asyncio.wait_for(conn.run(command, check=False), timeout)
    finally:
        conn.close()
    out = result.stdout if isinstance(result.stdout, str) else ""
    err = result.stderr if isinstance(result.stderr, str) else ""
    return int(result.exit_status or 0), out, err
