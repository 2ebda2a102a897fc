"""Join storm: N simulated agents join one `flodld serve --once` at once; how the controller holds up.

    .venv/bin/python bench/join_storm.py [--agents 1000,5000,10000] [--pollers 8] [--store-ranks 1000]

Per agent count, one fresh controller; printed as one table row each:
- admissions/s, against a same-run baseline: bare TCP connect + echo round trips on a plain asyncio
  server (the cost floor of any per-connection handshake), and their ratio;
- formation: the time from the first dial to the last WorldFormed, and from the last Accept to it;
- state.json p50/p99 while 8 pollers (a separate process) poll it during the storm, with the same HTTP
  path answering a 404 (no snapshot) as the baseline;
- controller RSS with every host linked, and per host: (linked - idle) / agents; the WorldFormed bytes
  each host received; the controller's CPU per admission (first dial to last WorldFormed, the pollers'
  requests included: a figure that holds on a loaded machine where rates do not), and this process's CPU
  per admission (the simulated agents, on the same cores).

Under each row, one line: the connect+echo baseline again with its echo server in a process of its own (as
the controller is; the table's baseline runs client and server on one event loop, which needs one core
whatever else runs), the share of the machine's cores other work used during the storm and during the
baseline (and the hypervisor's steal), and how much the kernel's TCP drop and retransmission counters grew
over the storm (ListenOverflows, ListenDrops, TCPReqQFullDrop, SyncookiesSent, TCPSynRetrans, TCPTimeouts,
RetransSegs; namespace-wide). On a shared two-core machine, a storm needs both cores (the controller one,
the simulated agents most of the other) and the in-process baseline one: other work on one core halves the
storm's rate and leaves the baseline's, so read the ratios with that line: a row where other work held a
quarter of the cores or more during the storm is marked CONTENDED.

The simulated agents (`LeanAgent`) speak the real join protocol with the real crypto (nonce exchange, HKDF
keys, AEAD-sealed Hello, verified and decoded Accept and WorldFormed, RankExited, close) through the same
sans-io `FrameConnection` as `flodld agent`, but as one asyncio protocol each, without stream readers,
writers, locks or timeouts per frame: that machinery was the simulator's cost, not the protocol's, and on
two shared cores it could set the admission rate instead of the controller.

Then a store storm: N simulated ranks each open a rendezvous connection and run gloo's init pattern
(add to the init counter, set its own address key, wait for and get its peers' keys, add to the done
counter) against the controller's store; store ops/s against a bare asyncio echo server doing the same
number of request/reply round trips over as many connections. `--store-peers` (default 32) is how many
peers each rank reads; `all` is gloo's full mesh, O(world²) ops in all.

`--profile-controller DIR` runs each controller under cProfile (stats in DIR; slower, for where the time
goes). This process runs without cyclic garbage collection during a storm (`quiet_collector`). A storm that
needs more descriptors than the hard limit allows (one socket per agent in the controller and here) is
skipped with the reason.

Every process the bench starts (the controller, the poller) is ended when it finishes, fails, times out
(`--timeout` per storm), or is interrupted (SIGINT, SIGTERM); the children also get SIGKILL if the bench
itself is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import resource
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flodld.net.stream import FramedStream, open_channel
from flodld.wire.frames import Frame, FrameConnection, Role
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Accept, Hello, RankExited, WorldFormed
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.messages import Message
from flodld.wire.salt import new_salt
from flodld.wire.store import (
    StoreAdd,
    StoreGet,
    StoreHello,
    StoreInt,
    StoreOk,
    StoreSet,
    StoreValue,
    StoreWait,
)

LISTENING_LINE = re.compile(rb"event=listening bind=\S+ port=(\d+)")
_CHILDREN: list[asyncio.subprocess.Process] = []


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
    _CHILDREN.append(proc)
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


def _kill_children_now() -> None:
    """Last resort (atexit, a loop already gone): SIGKILL every child still running."""
    for proc in _CHILDREN:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(proc.pid, signal.SIGKILL)


_PROFILE: list[str] = []
"""`--profile-controller DIR`: run each controller under cProfile, its stats written to DIR on exit."""


async def start_controller(
    *flags: str, once: bool = True
) -> tuple[asyncio.subprocess.Process, int, asyncio.Task[bytes]]:
    """`flodld serve` (one run, or with `once=False` a service running run after run on one port) on a
    free loopback port: the process, its port, and the task that keeps its log pipe drained.
    """
    profiler: list[str] = []
    if _PROFILE:
        target = Path(_PROFILE[0]) / f"controller-{len(_CHILDREN)}-{'-'.join(flags[:2])}.pstats"
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


# --- baselines ---------------------------------------------------------------------------------------


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                writer.write(await reader.readexactly(24))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
    return server, server.sockets[0].getsockname()[1]


async def _baseline_connects(count: int, in_flight: int, port: int | None = None) -> float:
    """Connections/s for connect + one 24-byte echo round trip on a bare asyncio server: in this process,
    or the one listening on `port` (`echo_main`, a process of its own as the controller is).
    """
    server: asyncio.Server | None = None
    if port is None:
        server, port = await _echo_server()
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"x" * 24)
            await reader.readexactly(24)
            writer.close()

    begun = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - begun
    if server is not None:
        server.close()
    return count / elapsed


async def echo_main() -> None:
    """Child process: the connect+echo baseline's server, in a process of its own (as the controller is),
    until stdin closes; prints its port first.
    """
    server, port = await _echo_server()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


async def _baseline_apart(count: int, in_flight: int) -> float:
    """`_baseline_connects` against an echo server in its own process."""
    echo = await spawn_process(
        sys.executable,
        __file__,
        "--echo-server",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert echo.stdout is not None
        port = int(await asyncio.wait_for(echo.stdout.readline(), 60))
        return await _baseline_connects(count, in_flight, port)
    finally:
        with contextlib.suppress(Exception):
            await echo.communicate(b"")
        await end_process(echo)


async def _baseline_round_trips(clients: int, per_client: int) -> float:
    """Round trips/s: `clients` connections each doing `per_client` 24-byte echoes, all at once."""
    server, port = await _echo_server()
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(per_client):
            writer.write(b"y" * 24)
            await reader.readexactly(24)

    begun = time.perf_counter()
    await asyncio.gather(*(one(r, w) for r, w in connections))
    elapsed = time.perf_counter() - begun
    for _, writer in connections:
        writer.close()
    server.close()
    return clients * per_client / elapsed


# --- the join storm ---------------------------------------------------------------------------------


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


async def _http_latency(port: int, path: str) -> float:
    begun = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    await reader.read()
    writer.close()
    return time.perf_counter() - begun


async def _poll(port: int, path: str, stop: asyncio.Event, samples: list[float]) -> None:
    while not stop.is_set():
        try:
            samples.append(await _http_latency(port, path))
        except OSError:
            return


async def poller_main(port: int, pollers: int) -> None:
    """Child process: poll state.json (and the 404 baseline) until stdin closes, then print JSON samples.

    A separate process, so the agents' own event-loop load does not inflate the latencies.
    """
    stop = asyncio.Event()
    state: list[float] = []
    baseline: list[float] = []
    await _http_latency(port, "/state.json")  # warm up, then tell the parent we are polling
    print("polling", flush=True)
    tasks = [asyncio.create_task(_poll(port, "/state.json", stop, state)) for _ in range(pollers)]
    tasks += [asyncio.create_task(_poll(port, "/nope", stop, baseline)) for _ in range(max(1, pollers // 4))]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    stop.set()
    await asyncio.gather(*tasks)
    print(json.dumps({"state": state, "baseline": baseline}))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_secs(pid: int) -> float:
    """User + system CPU seconds the process has used so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


# Kernel TCP counters worth a look around a storm (namespace-wide: other traffic on the machine counts too).
# A SYN or final ACK the kernel drops (full SYN or accept queue) costs the dialer a 1 s retransmission.
_KERNEL_COUNTERS = (
    ("TcpExt", "ListenOverflows"),
    ("TcpExt", "ListenDrops"),
    ("TcpExt", "TCPReqQFullDrop"),
    ("TcpExt", "SyncookiesSent"),
    ("TcpExt", "TCPSynRetrans"),
    ("TcpExt", "TCPTimeouts"),
    ("Tcp", "RetransSegs"),
)


def _time_wait() -> int:
    """TCP sockets in TIME_WAIT, namespace-wide (/proc/net/sockstat `tw`; -1 where it cannot be read).

    Each closed connection leaves one for 60 s on the side that closed first, and this bench closes tens of
    thousands (baselines, agents): with ~100,000 of them, connect() hunts for a free ephemeral port among
    `ip_local_port_range`'s 28,232 and the simulated agents' CPU per admission rises by a third, which a
    back-to-back series of runs shows as a falling ratio. Printed per row; let them drain (a minute) between
    runs that are to be compared.
    """
    try:
        for line in Path("/proc/net/sockstat").read_text().splitlines():
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("tw") + 1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def _kernel_counters() -> dict[str, int]:
    """The `_KERNEL_COUNTERS` from /proc/net/netstat and /proc/net/snmp (empty where they cannot be read)."""
    found: dict[str, int] = {}
    for name in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for header, values in zip(lines[::2], lines[1::2], strict=False):
            prefix, _, keys = header.partition(":")
            for key, value in zip(keys.split(), values.partition(":")[2].split(), strict=False):
                if (prefix, key) in _KERNEL_COUNTERS:
                    found[key] = int(value)
    return found


@dataclass
class MachineCpu:
    """CPU seconds the whole machine spent busy, and stolen by the hypervisor, since boot (/proc/stat)."""

    busy: float
    steal: float

    @staticmethod
    def now() -> MachineCpu:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return MachineCpu(float("nan"), float("nan"))
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return MachineCpu((user + nice + system + irq + softirq) / tick, steal / tick)


def _others_share(before: MachineCpu, after: MachineCpu, own_secs: float, wall: float) -> tuple[float, float]:
    """(CPU the rest of the machine used, CPU stolen) over `wall` seconds, as fractions of all its cores.

    `own_secs` is what the bench's own processes used; the rest is other work on the same cores, which on a
    shared machine sets the rates more than the code does.
    """
    cores = os.cpu_count() or 1
    others = max(0.0, after.busy - before.busy - own_secs)
    return others / (wall * cores), (after.steal - before.steal) / (wall * cores)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


@dataclass
class StormRow:
    agents: int
    admit_rate: float
    baseline_rate: float
    first_dial_to_formed_ms: float
    last_accept_to_formed_ms: float
    state_p50: float
    state_p99: float
    base_p50: float
    base_p99: float
    polls: int
    idle_rss: float
    peak_rss: float
    formed_bytes: int
    exit_code: int | None
    controller_cpu_secs: float = float("nan")
    agents_cpu_secs: float = float("nan")
    """The controller's CPU from the first dial to the last WorldFormed (pollers' requests included)."""
    others_storm: float = float("nan")
    """The share of the machine's cores other work used during the storm (not the controller, this process
    or the pollers)."""
    steal_storm: float = float("nan")
    others_baseline: float = float("nan")
    """The same during the connect+echo baseline (not this process)."""
    baseline_apart_rate: float = float("nan")
    """The connect+echo baseline with its server in a process of its own."""
    kernel: dict[str, int] = field(default_factory=dict)
    """The kernel's TCP drop and retransmission counters: their increase over the storm."""
    time_wait: int = -1
    """TCP sockets in TIME_WAIT when the storm began (/proc/net/sockstat; -1: not readable)."""

    @property
    def per_host_bytes(self) -> float:
        return (self.peak_rss - self.idle_rss) * 1024 * 1024 / self.agents


class TooFewDescriptors(Exception):
    """The storm cannot run here: the controller (and this process) need a socket per agent."""


async def join_storm(agents: int, pollers: int, in_flight: int) -> StormRow:
    raise_fd_limit(2 * agents + 1024)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < agents + 512:
        raise TooFewDescriptors(
            f"{agents:,} agents need a descriptor per agent in the controller and in this process "
            f"({agents + 512:,} with some room), and the limit here is {soft:,} (the hard limit, which only "
            "a process with CAP_SYS_RESOURCE may raise): not run"
        )
    token = new_salt()
    flags = ("--ranks", str(agents), "--token", token.hex(), "--window", "600")
    proc, port, drain = await start_controller(*flags)
    poller: asyncio.subprocess.Process | None = None
    agents_live: list[LeanAgent] = []
    loop = asyncio.get_running_loop()
    try:
        machine, own = MachineCpu.now(), time.process_time()
        baseline_begun = time.perf_counter()
        baseline_rate = await _baseline_connects(agents, in_flight)
        others_baseline, _ = _others_share(
            machine, MachineCpu.now(), time.process_time() - own, time.perf_counter() - baseline_begun
        )
        baseline_apart_rate = await _baseline_apart(agents, in_flight)
        idle_rss = _rss_mib(proc.pid)
        poller = await spawn_process(
            sys.executable,
            __file__,
            "--poller-for",
            str(port),
            "--pollers",
            str(pollers),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert poller.stdout is not None
        await asyncio.wait_for(poller.stdout.readline(), 60)  # the storm starts once the pollers are running

        accepted_at: list[float] = []
        formed_at: list[float] = []
        formed_bytes: list[int] = []
        everyone_formed = asyncio.Event()
        release = asyncio.Event()
        gate = asyncio.Semaphore(in_flight)

        async def agent(index: int) -> None:
            async with gate:
                hello = Hello(
                    host=f"bench-{index:05d}",
                    devices=["cpu:0"],
                    device_labels=[],
                    variant="cpu",
                    torch_version="bench",
                    protocol_version=JOIN_PROTOCOL_VERSION,
                )
                _, lean = await loop.create_connection(lambda: LeanAgent(token, hello), "127.0.0.1", port)
                agents_live.append(lean)
                reply = await asyncio.wait_for(lean.accepted, 120)
                accepted_at.append(time.perf_counter())
            formed_bytes.append(await asyncio.wait_for(lean.formed, 300))
            formed_at.append(time.perf_counter())
            if len(formed_at) == agents:
                everyone_formed.set()
            # Links stay open: RSS at its peak, and the run (and port) outlive the polling.
            await release.wait()
            # Nobody renumbers in a storm without departures: Accept's ranks are final.
            lean.leave([RankExited(rank=rank, code=0) for rank in reply.ranks])

        quiet_collector()
        time_wait = _time_wait()
        kernel_begun, machine_begun = _kernel_counters(), MachineCpu.now()
        poller_cpu_begun = _cpu_secs(poller.pid)
        begun, cpu_begun = time.perf_counter(), _cpu_secs(proc.pid)
        own_cpu_begun = time.process_time()
        storm: asyncio.Future[list[None]] = asyncio.gather(*(agent(i) for i in range(agents)))
        waiter: asyncio.Future[bool] = asyncio.ensure_future(everyone_formed.wait())
        await asyncio.wait([waiter, storm], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if storm.done():
            storm.result()  # an agent failed: raise its error
        peak_rss = _rss_mib(proc.pid)
        storm_cpu = _cpu_secs(proc.pid) - cpu_begun
        own_cpu = time.process_time() - own_cpu_begun
        others_storm, steal_storm = _others_share(
            machine_begun,
            MachineCpu.now(),
            storm_cpu + own_cpu + _cpu_secs(poller.pid) - poller_cpu_begun,
            time.perf_counter() - begun,
        )
        kernel_now = _kernel_counters()
        kernel = {key: kernel_now[key] - value for key, value in kernel_begun.items() if key in kernel_now}
        polled, _ = await poller.communicate(b"")
        release.set()
        await storm
        samples = json.loads(polled)
        code = await asyncio.wait_for(proc.wait(), 120)
        return StormRow(
            agents=agents,
            admit_rate=agents / (max(accepted_at) - begun),
            baseline_rate=baseline_rate,
            first_dial_to_formed_ms=(max(formed_at) - begun) * 1000,
            last_accept_to_formed_ms=(max(formed_at) - max(accepted_at)) * 1000,
            state_p50=_pct(samples["state"], 0.5),
            state_p99=_pct(samples["state"], 0.99),
            base_p50=_pct(samples["baseline"], 0.5),
            base_p99=_pct(samples["baseline"], 0.99),
            polls=len(samples["state"]),
            idle_rss=idle_rss,
            peak_rss=peak_rss,
            formed_bytes=max(formed_bytes),
            exit_code=code,
            controller_cpu_secs=storm_cpu,
            agents_cpu_secs=own_cpu,
            others_storm=others_storm,
            steal_storm=steal_storm,
            others_baseline=others_baseline,
            baseline_apart_rate=baseline_apart_rate,
            kernel=kernel,
            time_wait=time_wait,
        )
    finally:
        gc.enable()
        for lean in agents_live:
            lean.close()
        if poller is not None:
            await end_process(poller)
        await end_process(proc)
        drain.cancel()


# --- the store storm --------------------------------------------------------------------------------


async def _store_call(stream: FramedStream, request: Message, tail: bytes, kind: type[Message]) -> None:
    await stream.send(request, tail)
    message = (await stream.recv(300)).message()
    assert isinstance(message, kind), message


@dataclass
class StoreStormResult:
    ops: int
    rate: float
    """Store ops/s over the storm."""
    baseline: float
    """Bare asyncio echo round trips/s (client and server in this process)."""
    controller_cpu_secs: float
    """CPU the controller process used during the storm: the store's own cost, whatever else runs."""
    exit_code: int | None


async def store_storm(ranks: int, peers: int) -> StoreStormResult:
    """N simulated ranks doing gloo init's store pattern against `flodld serve`, and the echo baseline."""
    raise_fd_limit(2 * ranks + 1024)
    token, run_id = new_salt(), f"storm-{secrets.token_hex(4)}"
    proc, port, drain = await start_controller(
        "--ranks", "1", "--token", token.hex(), "--run-id", run_id, "--window", "600"
    )
    streams: list[FramedStream] = []
    try:
        for rank in range(ranks):
            stream = await open_channel("127.0.0.1", port, Channel.RENDEZVOUS, token, timeout=60)
            streams.append(stream)
            await _store_call(
                stream, StoreHello(run_id=run_id, rank=rank, client_id=secrets.token_hex(16)), b"", StoreOk
            )
        address = b"x" * 64

        async def rank_init(rank: int, stream: FramedStream) -> int:
            ops = 0
            request_id = 1

            def rid() -> int:
                nonlocal request_id
                request_id += 1
                return request_id

            await _store_call(stream, StoreAdd(key="/init/count", amount=1, request_id=rid()), b"", StoreInt)
            await _store_call(stream, StoreSet(key=f"/pg/rank/{rank}", request_id=rid()), address, StoreOk)
            ops += 2
            for step in range(1, peers + 1):
                key = f"/pg/rank/{(rank + step) % ranks}"
                await _store_call(stream, StoreWait(keys=[key], timeout=300), b"", StoreOk)
                await _store_call(stream, StoreGet(key=key, timeout=300), b"", StoreValue)
                ops += 2
            await _store_call(stream, StoreAdd(key="/init/done", amount=1, request_id=rid()), b"", StoreInt)
            return ops + 1

        begun, cpu_begun = time.perf_counter(), _cpu_secs(proc.pid)
        counts = await asyncio.gather(*(rank_init(rank, stream) for rank, stream in enumerate(streams)))
        elapsed, cpu = time.perf_counter() - begun, _cpu_secs(proc.pid) - cpu_begun
        ops = sum(counts)
    finally:
        for stream in streams:
            stream.close()
        code = await end_process(proc)  # no join: SIGTERM aborts the window (a failed verdict is expected)
        drain.cancel()
    baseline = await _baseline_round_trips(ranks, max(1, ops // ranks))
    return StoreStormResult(ops, ops / elapsed, baseline, cpu, code)


# --- main ------------------------------------------------------------------------------------------


def _table(rows: list[StormRow]) -> str:
    lines = [
        "| agents | admissions/s (TCP connect+echo baseline, ratio) | first dial → formed | last accept → "
        "formed | state.json p50 / p99 (404 baseline p50 / p99, polls) | controller RSS linked (idle) | RSS "
        "per host | WorldFormed bytes per host | controller CPU per admission | agents' CPU per admission | "
        "exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.agents:,} | {r.admit_rate:,.0f} ({r.baseline_rate:,.0f}, "
            f"{r.admit_rate / r.baseline_rate:.2f}) | {r.first_dial_to_formed_ms:,.0f} ms | "
            f"{r.last_accept_to_formed_ms:,.0f} ms | {r.state_p50:,.1f} / {r.state_p99:,.1f} ms "
            f"({r.base_p50:,.1f} / {r.base_p99:,.1f} ms, {r.polls}) | {r.peak_rss:,.0f} MiB "
            f"({r.idle_rss:,.0f} MiB) | {r.per_host_bytes / 1024:,.1f} KiB | {r.formed_bytes} B | "
            f"{r.controller_cpu_secs / r.agents * 1e6:,.0f} µs | "
            f"{r.agents_cpu_secs / r.agents * 1e6:,.0f} µs | {r.exit_code} |"
        )
    return "\n".join(lines)


# Other work's share of the cores during a storm above which the row is marked contended: a storm needs
# both cores of a two-core machine (the controller one, the simulated agents most of the other), so other
# work on half a core or more sets its rate and its latencies (2026-12-03, 20 runs at 10,000 agents: the four
# slow ones, 0.30-0.39 of the baseline, were the four where other work held 32-45 % of the cores; 0-4 % in
# the others, 0.51-0.62).
CONTENDED_SHARE = 0.25


def _machine_line(row: StormRow) -> str:
    """What else ran on the machine during the storm and its baseline, and what the kernel dropped."""
    kernel = ", ".join(f"{key} +{value}" for key, value in row.kernel.items()) or "not readable"
    contended = (
        f"CONTENDED (other work held {row.others_storm:.0%} of the cores during the storm: this row measures "
        "the machine more than the controller); "
        if row.others_storm >= CONTENDED_SHARE
        else ""
    )
    return contended + (
        f"connect+echo with the echo server in a process of its own {row.baseline_apart_rate:,.0f}/s "
        f"(ratio {row.admit_rate / row.baseline_apart_rate:.2f}); "
        f"other work used {row.others_storm:.0%} of the machine's cores during the storm (steal "
        f"{row.steal_storm:.0%}), {row.others_baseline:.0%} during the baseline; "
        f"{row.time_wait:,} TCP sockets in TIME_WAIT when the storm began; kernel TCP counters: {kernel}"
    )


async def main(options: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)
    rows: list[StormRow] = []
    status = 0
    print(
        f"join storm on {os.cpu_count()} CPU(s), {options.pollers} state.json pollers, "
        f"{options.in_flight} dials in flight at most",
        flush=True,
    )
    try:
        for agents in options.agents:
            try:
                row = await asyncio.wait_for(
                    join_storm(agents, options.pollers, options.in_flight), options.timeout
                )
            except TimeoutError:
                print(f"  {agents} agents: no formation within {options.timeout:g}s (timed out)", flush=True)
                status = 1
                continue
            except TooFewDescriptors as error:
                print(f"  {error}", flush=True)
                status = 1
                continue
            rows.append(row)
            print(_table([row]).splitlines()[-1], flush=True)
            print(f"  {_machine_line(row)}", flush=True)
        print()
        print(_table(rows))
        for row in rows:
            print(f"{row.agents:,} agents: {_machine_line(row)}")
        if options.store_ranks:
            ranks = options.store_ranks
            peers = ranks - 1 if options.store_peers == "all" else min(ranks - 1, int(options.store_peers))
            try:
                storm = await asyncio.wait_for(store_storm(ranks, peers), options.timeout)
            except TimeoutError:
                print(f"store storm: {ranks} ranks did not finish within {options.timeout:g}s (timed out)")
                return 1
            print()
            print(
                f"store storm: {ranks} ranks x (add, set, {peers} x (wait, get), add) = {storm.ops:,} ops: "
                f"{storm.rate:,.0f} ops/s; bare asyncio echo baseline {storm.baseline:,.0f} round trips/s; "
                f"ratio {storm.rate / storm.baseline:.2f}; controller CPU {storm.controller_cpu_secs:.2f} s "
                f"({storm.controller_cpu_secs / storm.ops * 1e6:.0f} µs/op) (controller exit "
                f"{storm.exit_code})"
            )
    finally:
        for proc in _CHILDREN:
            await end_process(proc, grace=5.0)
    return status


def _agent_counts(text: str) -> list[int]:
    return [int(part) for part in text.replace("_", "").split(",") if part.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=_agent_counts, default=[1000], help="comma-separated agent counts")
    parser.add_argument("--pollers", type=int, default=8)
    parser.add_argument(
        "--in-flight", type=int, default=2000, help="dials (handshake + hello) in flight at most"
    )
    parser.add_argument(
        "--store-ranks", type=int, default=1000, help="simulated ranks in the store storm (0: skip)"
    )
    parser.add_argument(
        "--store-peers", default="32", help="peers each rank reads in the store storm, or `all`"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per storm before giving up")
    parser.add_argument(
        "--profile-controller",
        metavar="DIR",
        help="run each controller under cProfile (slower: for where the time goes, not for the figures)",
    )
    parser.add_argument("--poller-for", type=int, help=argparse.SUPPRESS)  # internal: run as the poller child
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)  # internal: echo child
    options = parser.parse_args()
    if options.profile_controller:
        Path(options.profile_controller).mkdir(parents=True, exist_ok=True)
        _PROFILE.append(options.profile_controller)
    import atexit

    atexit.register(_kill_children_now)
    entry = (
        poller_main(options.poller_for, options.pollers)
        if options.poller_for
        else echo_main()
        if options.echo_server
        else main(options)
    )
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        sys.exit(runner(entry) or 0)
    except (KeyboardInterrupt, asyncio.CancelledError):
        _kill_children_now()
        sys.exit(130)
