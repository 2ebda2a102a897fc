"""The join storm's harness: its controller and other child processes, and `LeanAgent`, a simulated agent.

Shared by bench/join_storm.py and bench/reform.py. Every child started through `spawn_process` is listed
in `CHILDREN` and gets SIGKILL if the bench dies (PR_SET_PDEATHSIG); `kill_children_now` is the last
resort for a bench that is exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import resource
import signal
import sys
from pathlib import Path

from flodld.wire.frames import Frame, FrameConnection, Role
from flodld.wire.join import Accept, Hello, WorldFormed
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import Message

LISTENING_LINE = re.compile(rb"event=listening bind=\S+ port=(\d+)")
CHILDREN: list[asyncio.subprocess.Process] = []


def raise_fd_limit(wanted: int) -> None:
    """Raise this process's descriptor limit (inherited by the controller) to `wanted`: the hard limit too
    where the process may (root, CAP_SYS_RESOURCE: a 20,000-agent storm needs more than a common 20,000),
    else as far as the hard limit goes; says so when that is short of `wanted`.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    if hard < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return
        print(f"  descriptor limit {hard} < {wanted} wanted: the storm may run out of sockets", flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def spawn_process(*args: str, **kwargs: object) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(*args, preexec_fn=_die_with_parent, **kwargs)  # type: ignore[arg-type]
    CHILDREN.append(proc)
    return proc


async def end_process(proc: asyncio.subprocess.Process, grace: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode


def kill_children_now() -> None:
    """Last resort (atexit, a loop already gone): SIGKILL every child still running."""
    for proc in CHILDREN:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(proc.pid, signal.SIGKILL)


PROFILE: list[str] = []
"""`--profile-controller DIR`: run each controller under cProfile, its stats written to DIR on exit."""


async def start_controller(
    *flags: str, once: bool = True
) -> tuple[asyncio.subprocess.Process, int, asyncio.Task[bytes]]:
    """`flodld serve` (one run, or with `once=False` a service running run after run on one port) on a
    free loopback port: the process, its port, and the task that keeps its log pipe drained.
    """
    profiler: list[str] = []
    if PROFILE:
        target = Path(PROFILE[0]) / f"controller-{len(CHILDREN)}-{'-'.join(flags[:2])}.pstats"
        profiler = ["-m", "cProfile", "-o", str(target)]
    proc = await spawn_process(
        sys.executable, *profiler, "-m", "flodld", "serve", *(["--once"] if once else []), "--port", "0",
        "--bind", "127.0.0.1", *flags,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        if not line:
            raise SystemExit("flodld serve exited before listening")
        found = LISTENING_LINE.search(line)
        if found:
            # keep the log pipe flowing
            return proc, int(found.group(1)), asyncio.create_task(proc.stderr.read())


class LeanAgent(asyncio.Protocol):
    """One simulated agent's join link: the real protocol and the real crypto, without the agent's stream
    machinery.

    Magic and nonce, the controller's nonce, an AEAD-sealed Hello, the verified Accept (decoded and
    validated), then the verified WorldFormed, RankExited per rank and the close: what `flodld agent`
    sends and checks, through the same sans-io `FrameConnection`. What it leaves out is the simulator's
    overhead, not the protocol's: no StreamReader/StreamWriter, lock, timeout or coroutine step per frame
    (10,000 of them share this one process and the controller's two cores). Before this, the agents
    used `open_channel` + `FramedStream`, and in some runs this process, not the controller, set the
    admission rate.
    """

    def __init__(self, key: bytes, hello: Hello) -> None:
        self.conn = FrameConnection(Role.DIALER, key, channel=Channel.JOIN)
        self.hello = hello
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[Accept] = loop.create_future()
        self.formed: asyncio.Future[int] = loop.create_future()  # the WorldFormed payload's bytes
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(magic_prefix(Channel.JOIN) + self.conn.initial_bytes())  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        conn, transport = self.conn, self.transport
        assert transport is not None
        was_ready = conn.ready
        conn.receive_data(data)
        if not was_ready and conn.ready:
            transport.write(conn.send_message(self.hello))
        while True:
            event = conn.next_event()  # a WireError here fails the bench: the controller broke the protocol
            if not isinstance(event, Frame):
                return
            if not self.accepted.done():
                reply = event.message()
                if not isinstance(reply, Accept):
                    self.accepted.set_exception(AssertionError(f"expected Accept, got {reply!r}"))
                    return
                self.accepted.set_result(reply)
            elif not self.formed.done():
                world = event.message()  # decoded and validated, as an agent does before it starts ranks
                if not isinstance(world, WorldFormed):
                    self.formed.set_exception(AssertionError(f"expected WorldFormed, got {world!r}"))
                    return
                self.formed.set_result(len(event.payload))

    def connection_lost(self, exc: Exception | None) -> None:
        for waiter in (self.accepted, self.formed):
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"the controller closed the join link ({exc!r})"))

    def leave(self, reports: list[Message]) -> None:
        assert self.transport is not None
        for report in reports:
            self.transport.write(self.conn.send_message(report))
        self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()



def quiet_collector() -> None:
    """No cyclic garbage collection in this process during a storm (re-enabled after it).

    Thousands of simulated agents live in this one process; their objects are freed by reference
    counting, and the full collections their growing number triggers (about a sixth of this process's
    CPU at 5,000 agents) are a cost of the simulation, not of the controller, that a real fleet spreads
    over its machines: here it would take CPU from the controller on the same cores.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
