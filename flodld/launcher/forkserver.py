"""The fork server's loop: fork one rank per request, report each one's exit, kill an agent's ranks with it.

`python -m flodld.launcher.rank --fork-server FD` (started by `fdl join --persist` and `fdl run`, see
`flodld.agent.forkserver.HostForkServer`) loads torch and what a rank with a relay opens first, then
serves the unix SOCK_SEQPACKET socket FD it inherits. Who may speak: a process of this user (the socket
lives in a directory only this user can enter, and every connection's peer credentials are checked);
what it may cause: ranks (and relays) started with the command line and environment it sends, as it
could start them itself, only faster. Each connection is one agent. A request is a `ForkRequest`
(`flodld.rank.warm`: the hand-off, then how many output streams and passed descriptors ride with it as
SCM_RIGHTS); the reply is `Forked(pid)` or `Refused(reason)`, and `Exited(pid, code)` follows when that
child ends. `Forked` comes once the child has its own session and its death signal armed, so the
agent's SIGKILL to its process group can never miss it. When the agent's connection closes (it exited,
or was killed) every child it asked for that still runs is killed with its process group: no rank
outlives its agent, as a rank started by the agent itself gets SIGKILL when the agent dies.

The server is one thread and one `selectors` loop (so forking is safe: no lock of ours is held by
another thread; torch's own import leaves one idle native thread, which a fork does not copy). The child
leaves the loop by returning from `serve` with its argv, its environment replaced, in a session of its
own, its stdio the streams it was sent, the passed descriptors from FIRST_PASSED_FD on, and a SIGKILL
armed for the server's death; the launcher then runs the rank exactly as a cold `python -m
flodld.launcher.rank SCRIPT.py` would (a relay: as `python -m flodld.launcher`). The server ends when its
stdin reaches EOF (its starter exited or closed it), killing and reaping every child it started first.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import selectors
import signal
import socket
import sys
from collections.abc import Iterator

from flodld.agent.spawn import die_with_parent
from flodld.rank.warm import (
    FIRST_PASSED_FD,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_FDS,
    Exited,
    Forked,
    ForkReply,
    ForkRequest,
    HandoffError,
    Ready,
    Refused,
    decode_fork_request,
    encode_reply,
    startup_variables,
)

_HIGH_FD = 64


class _Connection:
    """One agent: its socket and the ranks it asked for that have not been reaped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ranks: set[int] = set()

    def send(self, reply: ForkReply) -> bool:
        """Send one reply; False when the agent cannot take it (gone, or not reading: it is then dropped)."""
        try:
            self.sock.send(encode_reply(reply))
        except OSError:
            return False
        return True


class _ChildStarts(Exception):
    """Raised in a freshly forked child to leave the server loop with the rank's argv."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__()
        self.argv = argv


def serve(listener: socket.socket) -> list[str]:
    """Serve fork requests on `listener` until stdin closes (then exit); returns only in a forked child,
    with the argv of the rank it is to run.
    """
    server = _Server(listener)
    try:
        server.run()
    except _ChildStarts as starts:
        return starts.argv
    server.shutdown()
    sys.exit(0)


class _Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.connections: dict[int, _Connection] = {}  # by socket fd
        self.owner: dict[int, _Connection | None] = {}  # rank pid -> its agent (None: that agent is gone)
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # the wake-up fd does the work
        self.startup = startup_variables(os.environ)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wake_read, selectors.EVENT_READ, self._reap)
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, self._parent_check)
        self.running = True

    def run(self) -> None:
        while self.running:
            for key, _ in self.selector.select():
                key.data(key)

    def _parent_check(self, _key: selectors.SelectorKey) -> None:
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except BlockingIOError:
            return
        if not data:  # `fdl join` is gone or closed us: every rank we started goes with us
            self.running = False

    def _accept(self, _key: selectors.SelectorKey) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = int.from_bytes(creds[4:8], sys.byteorder)
        if uid != os.getuid():  # the directory already keeps others out; this is the second lock
            sock.close()
            return
        sock.setblocking(False)
        connection = _Connection(sock)
        self.connections[sock.fileno()] = connection
        self.selector.register(sock, selectors.EVENT_READ, self._request)
        if not connection.send(Ready(self.startup)):
            self._drop(connection)

    def _request(self, key: selectors.SelectorKey) -> None:
        connection = self.connections[key.fd]
        try:
            packet, fds, flags, _ = socket.recv_fds(connection.sock, MAX_REQUEST_BYTES + 1, MAX_REQUEST_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            packet, fds, flags = b"", [], 0
        if not packet:
            self._drop(connection)
            return
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(packet) > MAX_REQUEST_BYTES:
                raise HandoffError(
                    f"a fork request over {MAX_REQUEST_BYTES} bytes or {MAX_REQUEST_FDS} descriptors"
                )
            request = decode_fork_request(packet, len(fds))
        except HandoffError as error:
            for fd in fds:
                os.close(fd)
            if not connection.send(Refused(str(error))):
                self._drop(connection)
            return
        self._fork(connection, request, fds)

    def _fork(self, connection: _Connection, request: ForkRequest, fds: list[int]) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered here may be written twice
        server_pid = os.getpid()
        try:
            settled_read, settled_write = os.pipe()
            pid = os.fork()
        except OSError as error:
            for fd in fds:
                os.close(fd)
            if not connection.send(Refused(f"fork failed: {error}")):
                self._drop(connection)
            return
        if pid == 0:
            try:
                os.close(settled_read)
                self._become_rank(server_pid, request, fds, settled_write)
            except BaseException:  # never back into the server's loop
                os._exit(70)
            raise _ChildStarts(request.argv)
        for fd in (*fds, settled_write):
            os.close(fd)
        # Forked means: in its own session, its death signal armed. Until then its agent's SIGKILL to its
        # process group (its pid) would find no group and miss it.
        with contextlib.suppress(OSError):
            os.read(settled_read, 1)  # a byte, or EOF if it died first (its exit is reported as any)
        os.close(settled_read)
        self.owner[pid] = connection
        connection.ranks.add(pid)
        if not connection.send(Forked(pid)):
            self._drop(connection)

    def _become_rank(self, server_pid: int, request: ForkRequest, fds: list[int], settled: int) -> None:
        """In the child: shed the server, take the rank's session, stdio and environment."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.listener.close()
        for connection in self.connections.values():
            connection.sock.close()
        os.close(self.wake_read)
        os.close(self.wake_write)
        os.setsid()  # its own process group, as the agent's cold children have: teardown reaches its tree
        _die_with(server_pid)
        os.write(settled, b"\0")
        os.close(settled)
        # Out of the way of the numbers they take (0-2, then FIRST_PASSED_FD on) before any is placed.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, _HIGH_FD) for fd in fds]
        for fd in fds:
            os.close(fd)
        streams, passed = high[: request.streams], high[request.streams :]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(streams[0], 1)
        os.dup2(streams[-1], 2)
        for number, fd in enumerate(passed, FIRST_PASSED_FD):
            os.dup2(fd, number)  # inheritable, as the cold child's pass_fds
        for fd in high:
            os.close(fd)
        os.environ.clear()  # exactly the rank's environment, as if it had been started with it
        os.environ.update(request.env)
        # What the server loaded stays frozen (gc.freeze in `preload`): the rank's collections skip it, so
        # they neither spend CPU on torch's objects nor copy the pages the forks share.

    def _reap(self, _key: selectors.SelectorKey) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_read, 512):
                pass
        for pid, code in exited_children():
            connection = self.owner.pop(pid, None)
            if connection is not None:
                connection.ranks.discard(pid)
                if not connection.send(Exited(pid, code)):
                    self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        """The agent is gone (or misbehaved): its ranks go too."""
        fd = connection.sock.fileno()
        if fd in self.connections:
            del self.connections[fd]
            self.selector.unregister(connection.sock)
        connection.sock.close()
        for pid in connection.ranks:
            _kill_group(pid)
            self.owner[pid] = None  # still reaped here, reported to no one
        connection.ranks.clear()

    def shutdown(self) -> None:
        """Kill every rank, reap each (reported to its agent, which then knows it gone), then hang up."""
        for pid in self.owner:
            _kill_group(pid)
        for pid, connection in list(self.owner.items()):
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                continue
            if connection is not None:
                connection.send(Exited(pid, os.waitstatus_to_exitcode(status)))
        self.owner.clear()
        for connection in list(self.connections.values()):
            self._drop(connection)


def exited_children() -> Iterator[tuple[int, int]]:
    """Reap, without blocking, every child that has ended: (pid, its exit code as subprocess reports it,
    -N for signal N).
    """
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _kill_group(pid: int) -> None:
    """SIGKILL a rank and its process group. The rank itself too: a rank killed right after its fork may
    not have made its session yet (then there is no group of that id), and it is our child, unreaped, so
    its pid is still its own.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _die_with(server_pid: int) -> None:
    """SIGKILL when the server dies; if it already has (the fork raced its death), go now."""
    die_with_parent()
    if os.getppid() != server_pid:
        os._exit(1)


def warm_optimizer() -> None:
    """Build a throwaway optimizer: torch.optim's first one imports what it needs lazily (torch._dynamo and
    sympy in torch 2.x: about 0.7 CPU-seconds and 800 modules here), a cost every training rank would
    otherwise pay on its first step, while the members it walks in beside train on the same cores. A torch
    whose optimizer cannot be built here (a build without it) leaves that to the rank, as a cold start does.
    """
    import torch

    try:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    except Exception as error:  # the rank pays for it itself, as a cold start would
        sys.stderr.write(f"flodld fork server: optimizer not preloaded ({type(error).__name__}: {error})\n")


def preload() -> None:
    """What every rank would import first, loaded once here; then frozen, so the forks share its pages."""
    import torch.distributed  # noqa: F401

    import flodld.rank.averaging
    import flodld.rank.relay_client  # noqa: F401

    warm_optimizer()
    gc.collect()
    gc.freeze()
