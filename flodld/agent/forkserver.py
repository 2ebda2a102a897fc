"""The agent's side of its host's fork server (flodld.launcher.forkserver): ranks forked, not started.

`fdl join` keeps a fork server (torch loaded once) for the agents it starts, one after another, and names
its socket in `FORK_SERVER_ENV`. The agent connects once, for its lifetime: the connection is what keeps
its forked ranks alive (the server kills them when it closes). A rank is asked of the server when its
command is this interpreter's `-m flodld.launcher.rank SCRIPT.py ...` on a CPU device and its start-up
variables (`flodld.rank.warm.startup_variables`) equal the server's; otherwise, or when the server
refuses or does not answer, the rank starts cold with one line saying why. A forked rank is a
`ForkedRank`: the agent supervises it as it does a child of its own (pid, output pipes, exit code).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from flodld.agent.spawn import (
    RELAY_HANDOFF,
    die_with_parent,
    warm_environment,
    warm_handoff_argv,
    warm_rank_command,
)
from flodld.agent.spec import DeviceError, resolve_devices
from flodld.rank.warm import (
    FORK_SERVER_FLAG,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    Exited,
    Forked,
    ForkReply,
    ForkReplyError,
    ForkRequest,
    HandoffError,
    Ready,
    Refused,
    decode_reply,
    encode_fork_request,
    startup_differences,
)

FORK_REPLY_SECS = 5.0
"""How long the agent waits for the server to fork a rank before it starts the rank cold."""
READY_SECS = 60.0
"""How long the agent's first rank waits for a server still loading torch (as long as a cold start of a
rank on a busy host): a server started with the persist loop is loading while the first agent joins."""


class ForkedRank:
    """A rank the fork server started for this agent, with the surface the agent uses of a child process."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader | None) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class ForkServer:
    """One agent's connection to its host's fork server."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ready: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        self._pending: collections.deque[asyncio.Future[Forked | Refused]] = collections.deque()
        self._ranks: dict[int, ForkedRank] = {}
        self._early: dict[int, int] = {}  # exits reported before their rank's ForkedRank existed
        self.closed = False
        self.used = 0
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    @classmethod
    async def connect(cls, path: str, say: Callable[[str], None]) -> ForkServer | None:
        """The server at `path`, or None (said why) when it cannot be reached: ranks then start cold. The
        connection waits in the server's backlog while it loads torch; its `Ready` comes then.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            sock.connect(path)
        except OSError as error:
            sock.close()
            say(f"fork server {path} not used, ranks start cold: {error}")
            return None
        return cls(sock)

    async def startup(self, timeout: float = READY_SECS) -> dict[str, str]:
        """The server's start-up variables, once it has loaded torch (ConnectionError: gone; TimeoutError)."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def take(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        device: str,
        split_stderr: bool,
        say: Callable[[str], None],
    ) -> ForkedRank | None:
        """The rank `argv` with `env`, forked by the server; None (said why) when it should start cold."""
        handoff = warm_handoff_argv(argv)
        label = f"rank {env.get('RANK', '?')}"
        if handoff is not None and device.startswith("cpu"):
            request = ForkRequest(handoff, dict(env), streams=2 if split_stderr else 1)
            return await self._take(label, request, [], say)
        why = "the program is not a Python script" if handoff is None else f"device {device} is not a CPU"
        say(f"{label} not forked by the fork server, starting it cold: {why}")
        return None

    async def take_relay(
        self, env: Mapping[str, str], listener: int, say: Callable[[str], None]
    ) -> ForkedRank | None:
        """The relay (`env` names its role, its spec's rank listener at FIRST_PASSED_FD), forked by the
        server with `listener` passed; None (said why) when it should start cold.
        """
        return await self._take("relay", ForkRequest(list(RELAY_HANDOFF), dict(env)), [listener], say)

    async def _take(
        self, label: str, request: ForkRequest, passed: list[int], say: Callable[[str], None]
    ) -> ForkedRank | None:
        try:
            if self.closed:
                raise HandoffError("the fork server is gone")
            differences = startup_differences(await self.startup(), request.env)
            if differences:
                raise HandoffError(f"start-up variables differ ({', '.join(differences)})")
            child = await self._fork(request, passed)
        except TimeoutError:
            why = "the fork server did not answer in time"
        except (OSError, HandoffError) as error:
            why = str(error) or type(error).__name__
        else:
            say(f"{label} forked by this host's fork server (pid {child.pid})")
            return child
        say(f"{label} not forked by the fork server, starting it cold: {why}")
        return None

    async def _fork(self, request: ForkRequest, passed: list[int]) -> ForkedRank:
        packet = encode_fork_request(replace(request, passed=len(passed)))
        if len(packet) > MAX_REQUEST_BYTES:
            raise HandoffError(f"its hand-off of {len(packet)} bytes is over {MAX_REQUEST_BYTES}")
        split_stderr = request.streams == 2
        pipes = [os.pipe() for _ in range(request.streams)]
        try:
            reply: asyncio.Future[Forked | Refused] = asyncio.get_running_loop().create_future()
            self._pending.append(reply)
            try:
                socket.send_fds(self._sock, [packet], [write for _, write in pipes] + passed)
            except OSError:
                self._pending.remove(reply)
                raise
        finally:
            for _, write in pipes:
                os.close(write)  # the rank holds them now (or no one does)
        try:
            answer = await asyncio.wait_for(asyncio.shield(reply), FORK_REPLY_SECS)
        except BaseException:
            for read, _ in pipes:
                os.close(read)
            raise
        if isinstance(answer, Refused):
            for read, _ in pipes:
                os.close(read)
            raise HandoffError(f"the fork server refused: {answer.reason}")
        streams = [await _reader(read) for read, _ in pipes]
        rank = ForkedRank(answer.pid, streams[0], streams[1] if split_stderr else None)
        self._ranks[answer.pid] = rank
        if answer.pid in self._early:
            rank._exit(self._early.pop(answer.pid))
        self.used += 1
        return rank

    def _readable(self) -> None:
        try:
            packet = self._sock.recv(MAX_REPLY_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            packet = b""
        if not packet:
            self._lost("the fork server closed its connection")
            return
        try:
            reply = _decode(packet)
        except ForkReplyError as error:
            self._lost(str(error))
            return
        if isinstance(reply, Ready) and not self._ready.done():
            self._ready.set_result(reply.startup)
        elif not self._ready.done():
            self._lost(f"expected the fork server's Ready, got {type(reply).__name__}")
        elif isinstance(reply, Exited):
            rank = self._ranks.pop(reply.pid, None)
            if rank is not None:
                rank._exit(reply.code)
            else:
                self._early[reply.pid] = reply.code
        elif isinstance(reply, Forked | Refused) and self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_result(reply)
        else:
            self._lost(f"unexpected {type(reply).__name__} from the fork server")

    def _lost(self, why: str) -> None:
        """The server is gone or spoke out of turn. Its ranks die with it (the death signal each armed, or the
        close of this connection): each is reported killed.
        """
        self.close()
        if not self._ready.done():
            self._ready.set_exception(ConnectionError(why))
            self._ready.exception()  # retrieved: no agent may ever ask
        for future in self._pending:
            if not future.done():
                future.set_exception(ConnectionError(why))
        self._pending.clear()
        for rank in self._ranks.values():
            rank._exit(-signal.SIGKILL)
        self._ranks.clear()

    def close(self) -> None:
        """End the connection: the server kills every rank of this agent still running."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()


def _decode(packet: bytes) -> ForkReply:
    if not packet:
        raise ForkReplyError("the fork server closed the connection")
    return decode_reply(packet)


async def _reader(fd: int) -> asyncio.StreamReader:
    """An asyncio stream over the read end of a rank's output pipe."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    await loop.connect_read_pipe(lambda: protocol, os.fdopen(fd, "rb", 0))
    return reader


class HostForkServer:
    """A fork server kept by `fdl join` for the agents it starts one after another: its process and socket.

    Started only for a host of CPU ranks named up front (`--devices cpu:N`, `cpu,cpu`): the server loads
    torch with the start-up environment those ranks will have (their OpenMP thread count depends on how
    many share the host), and a GPU rank is never forked (CUDA must not be set up before a fork).
    """

    def __init__(self, process: subprocess.Popen[bytes], path: str) -> None:
        self.process = process
        self.path = path

    @classmethod
    def start(
        cls,
        devices: Sequence[str] | None,
        directory: str,
        environ: Mapping[str, str],
        *,
        drop: Sequence[str] = (),
    ) -> HostForkServer | None:
        """A server listening in `directory` (one only this user can enter), or None when this host's ranks
        are not all CPU ranks named up front. `drop`: variables the server must not hold (the join token).
        """
        try:
            resolved = resolve_devices(list(devices), cuda_count=0) if devices else []
        except DeviceError:
            return None
        if not resolved or not all(device.startswith("cpu") for device in resolved):
            return None
        path = os.path.join(directory, "fork-server")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(64)
            env = warm_environment(
                {name: value for name, value in environ.items() if name not in drop},
                local_world_size=len(resolved),
            )
            process = subprocess.Popen(
                [*warm_rank_command()[:-1], FORK_SERVER_FLAG, str(listener.fileno())],
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=[listener.fileno()],
                start_new_session=True,  # a Ctrl-C at `fdl join` reaches it through its stdin, not SIGINT
                preexec_fn=die_with_parent,
            )
        finally:
            listener.close()
        return cls(process, path)

    def close(self) -> None:
        """Stop the server (EOF on its stdin): every rank it forked that still runs is killed with it."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
