"""`fdl join --ssh`: a local OpenSSH forward to the controller, fresh for every join attempt.

`ssh -N -L 127.0.0.1:<ephemeral>:ADDR` with BatchMode=yes (never a password prompt; a key or
an agent must work), ExitOnForwardFailure=yes (a forward that cannot be set up ends ssh
instead of leaving a useless session) and keepalives. The OpenSSH client is used, not
asyncssh, so the user's ~/.ssh/config, agent and known_hosts apply exactly as for `ssh`.
Readiness is observed without connecting through the forward (a probe connection would
reach the controller as a junk peer): once ssh has bound the chosen local port, it is up.

The forward is dialed only once its listening socket is shown to be ssh's own: every socket
listening where a dial of 127.0.0.1:<port> could land (from /proc/net/tcp and tcp6) must be
an open file of a process in ssh's session (/proc/<pid>/fd). Otherwise another local user may
have bound the port first (between our probe and ssh's bind) to play controller; the attempt is
refused instead. ControlMaster is off so that no shared master (not our child) holds the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.fanout.localagent import stop_local_agent
from flodld.fanout.ssh import SshEndpoint

FORWARD_READY_TIMEOUT_S = 30.0
PORT_ATTEMPTS = 3


class ForwardError(ConnectionError):
    """The forward could not be brought up; the message carries ssh's own explanation."""


def free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_bound(port: int) -> bool:
    """True once something listens on 127.0.0.1:port (probed by binding, not by connecting)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        return False


def forward_command(
    endpoint: SshEndpoint,
    local_port: int,
    remote: tuple[str, int],
    *,
    ssh_binary: str = "ssh",
    connect_timeout: float = FORWARD_READY_TIMEOUT_S,
) -> list[str]:
    """The ssh argv for one forward (pure; the identity file is the only credential named)."""
    remote_host, remote_port = remote
    target_host = f"[{remote_host}]" if ":" in remote_host else remote_host
    argv = [
        ssh_binary, "-N", "-T",
        "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "LogLevel=ERROR",
        "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3",
        "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
        "-o", "ControlMaster=no", "-o", "ControlPath=none",  # the forward must be this child's own
        "-p", str(endpoint.port),
    ]  # fmt: skip
    if endpoint.user:
        argv += ["-l", endpoint.user]
    if endpoint.identity_file:
        argv += ["-i", endpoint.identity_file, "-o", "IdentitiesOnly=yes"]
    for key, value in endpoint.parsed.items():
        if key != "BatchMode":  # never let a config turn password prompts back on
            argv += ["-o", f"{key}={value}"]
    # `--`: the destination is never read as an option (a host `-oProxyCommand=...` would run a command).
    argv += ["-L", f"127.0.0.1:{local_port}:{target_host}:{remote_port}", "--", endpoint.host]
    return argv


_TCP_LISTEN = "0A"
# Local addresses (as /proc/net/tcp{,6} write them) at which a dial of 127.0.0.1 can land.
_REACHES_LOOPBACK = frozenset(
    {
        "0100007F",
        "00000000",  # 127.0.0.1, 0.0.0.0
        "00000000000000000000000000000000",  # :: (dual-stack unless IPV6_V6ONLY, which /proc does not show)
        "0000000000000000FFFF00000100007F",
        "0000000000000000FFFF000000000000",  # ::ffff:127.0.0.1, ::ffff:0.0.0.0
    }
)


class ForwardOwnerUnknown(ForwardError):
    """This platform does not let us see who owns a listening socket (no /proc)."""


def loopback_listeners(port: int, *, proc: str = "/proc") -> set[int]:
    """Socket inodes of every TCP listener that a dial of 127.0.0.1:`port` could reach."""
    inodes: set[int] = set()
    found_table = False
    for table in ("net/tcp", "net/tcp6"):
        try:
            with open(os.path.join(proc, table)) as handle:
                lines = handle.readlines()[1:]
        except FileNotFoundError:
            continue
        found_table = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            address, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) == port and address.upper() in _REACHES_LOOPBACK:
                inodes.add(int(fields[9]))
    if not found_table:
        raise ForwardOwnerUnknown(
            f"cannot tell who listens on 127.0.0.1:{port} ({proc}/net/tcp is missing): `fdl join --ssh` "
            "verifies that the forward belongs to its own ssh and needs Linux /proc for that"
        )
    return inodes


def session_socket_inodes(session: int, *, proc: str = "/proc") -> set[int]:
    """Socket inodes open in any process of `session` (ssh runs as its leader: start_new_session)."""
    inodes: set[int] = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat")) as handle:
                stat = handle.read()
            if (
                int(stat.rpartition(")")[2].split()[3]) != session
            ):  # fields after comm: state ppid pgrp session
                continue
            fd_dir = os.path.join(proc, entry, "fd")
            for fd in os.listdir(fd_dir):
                target = os.readlink(os.path.join(fd_dir, fd))
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except (OSError, ValueError, IndexError):
            continue  # gone, or not ours to read: its sockets do not count as ssh's
    return inodes


def forward_owner(port: int, ssh_pid: int, *, proc: str = "/proc") -> str:
    """'none' (nothing listens yet), 'ssh' (every listener is ssh's own) or 'foreign'."""
    listeners = loopback_listeners(port, proc=proc)
    if not listeners:
        return "none"
    return "ssh" if listeners <= session_socket_inodes(ssh_pid, proc=proc) else "foreign"


@dataclass
class LocalForward:
    """A running `ssh -N -L`; dial 127.0.0.1:`local_port`. `close()` is idempotent."""

    local_port: int
    process: subprocess.Popen[bytes]
    endpoint: SshEndpoint

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, *, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def open_forward(
    endpoint: SshEndpoint,
    remote: tuple[str, int],
    *,
    ssh_binary: str | None = None,
    timeout: float = FORWARD_READY_TIMEOUT_S,
) -> LocalForward:
    """Start the forward on a fresh ephemeral port and block until ssh has bound it."""
    binary = ssh_binary or shutil.which("ssh")
    if binary is None:
        raise ForwardError("`ssh` (the OpenSSH client) is not on PATH; install openssh-client for --ssh")
    last = ""
    for _ in range(PORT_ATTEMPTS):  # another process may grab the port between our probe and ssh's bind
        port = free_local_port()
        argv = forward_command(endpoint, port, remote, ssh_binary=binary, connect_timeout=timeout)
        with tempfile.TemporaryFile() as errors:  # a file, not a pipe: ssh may outlive our reading
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                start_new_session=True,
            )
            forward = LocalForward(port, process, endpoint)
            deadline = time.monotonic() + timeout
            try:
                while process.poll() is None and time.monotonic() < deadline:
                    if _port_bound(port):
                        owner = forward_owner(port, process.pid)
                        if owner == "ssh":
                            return forward
                        if owner == "foreign":
                            raise ForwardError(squatter_message(port, endpoint))
                    time.sleep(0.05)
            except BaseException:
                forward.close()
                raise
            if process.poll() is None:
                forward.close()
                raise ForwardError(f"ssh forward via {endpoint.label} not up within {timeout:g}s")
            errors.seek(0)
            last = errors.read().decode(errors="replace").strip()
        if "Address already in use" not in last:
            break
        if loopback_listeners(port):  # ssh lost the port to a listener it never saw: never dial that one
            raise ForwardError(squatter_message(port, endpoint))
    raise ForwardError(
        f"ssh forward via {endpoint.label} to {remote[0]}:{remote[1]} failed: {last or 'ssh exited'}"
        " — check the key (--identity), that the host accepts it without a password, and that the"
        " sshd permits forwarding to that address"
    )


def squatter_message(port: int, endpoint: SshEndpoint) -> str:
    return (
        f"REFUSING to dial 127.0.0.1:{port}: another process (not this join's own ssh) is listening there, "
        f"where the forward via {endpoint.label} should be — a local user may be impersonating the "
        "controller to hand this host's ranks its environment and code. Find it with `ss -ltnp 'sport = "
        f":{port}'`; nothing was sent to it"
    )


@contextlib.asynccontextmanager
async def forwarded(
    endpoint: SshEndpoint, remote: tuple[str, int], *, timeout: float = FORWARD_READY_TIMEOUT_S
) -> AsyncIterator[int]:
    """One attempt's forward, as a context manager that gives the local port.

    Usage: `async with forwarded(ep, ("127.0.0.1", 1337)) as port:`.
    """
    forward = await asyncio.to_thread(open_forward, endpoint, remote, timeout=timeout)
    try:
        yield forward.local_port
    finally:
        await asyncio.to_thread(forward.close)


def parse_ssh_target(target: str, identity: str | None = None, options: Sequence[str] = ()) -> SshEndpoint:
    """`[user@]host[:port]` from the command line, with `--identity KEY`."""
    return SshEndpoint.parse(target, identity_file=identity, options=tuple(options))


async def run_agent_through_forward(
    endpoint: SshEndpoint,
    remote: tuple[str, int],
    spec: AgentSpec,
    command: Sequence[str],
    *,
    environ: Mapping[str, str],
    timeout: float = FORWARD_READY_TIMEOUT_S,
) -> int:
    """One `fdl join --ssh` attempt: a fresh forward, the agent dialing its local end, then teardown.

    `spec.controller_host/port` are replaced by the forward's local end; the agent rewrites the
    formed world's controller address to that same end, so relays and ranks use the forward too.
    Returns the agent's exit code (ForwardError when the forward cannot be brought up).
    """
    async with forwarded(endpoint, remote, timeout=timeout) as port:
        dialed = spec.model_copy(update={"controller_host": "127.0.0.1", "controller_port": port})
        process = await asyncio.create_subprocess_exec(
            *command, env={**environ, AGENT_ENV: encode_spec(dialed)}, stdin=asyncio.subprocess.DEVNULL
        )
        try:
            return await process.wait()
        finally:
            await stop_local_agent(process, spec.grace_secs)
