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
import resource
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The baselines (bare asyncio echo servers), the harness (controller and child processes, `LeanAgent`) and
# the figures (what is read of the machine, the row, the table) are modules of their own beside this one;
# bench/reform.py shares the harness.
from storm_baselines import baseline_connects, baseline_round_trips, echo_main
from storm_figures import (
    MachineCpu,
    StormRow,
    cpu_secs,
    kernel_counters,
    machine_line,
    others_share,
    percentile_ms,
    rss_mib,
    sockets_in_time_wait,
    table,
)
from storm_harness import (
    CHILDREN,
    PROFILE,
    LeanAgent,
    end_process,
    kill_children_now,
    quiet_collector,
    raise_fd_limit,
    spawn_process,
    start_controller,
)

from flodld.net.stream import FramedStream, open_channel
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Hello, RankExited
from flodld.wire.magic import Channel
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

# --- baselines ---------------------------------------------------------------------------------------


async def _baseline_apart(count: int, in_flight: int) -> float:
    """`baseline_connects` against an echo server in its own process."""
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
        return await baseline_connects(count, in_flight, port)
    finally:
        with contextlib.suppress(Exception):
            await echo.communicate(b"")
        await end_process(echo)


# --- the join storm ---------------------------------------------------------------------------------


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
        baseline_rate = await baseline_connects(agents, in_flight)
        others_baseline, _ = others_share(
            machine, MachineCpu.now(), time.process_time() - own, time.perf_counter() - baseline_begun
        )
        baseline_apart_rate = await _baseline_apart(agents, in_flight)
        idle_rss = rss_mib(proc.pid)
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
        time_wait = sockets_in_time_wait()
        kernel_begun, machine_begun = kernel_counters(), MachineCpu.now()
        poller_cpu_begun = cpu_secs(poller.pid)
        begun, cpu_begun = time.perf_counter(), cpu_secs(proc.pid)
        own_cpu_begun = time.process_time()
        storm: asyncio.Future[list[None]] = asyncio.gather(*(agent(i) for i in range(agents)))
        waiter: asyncio.Future[bool] = asyncio.ensure_future(everyone_formed.wait())
        await asyncio.wait([waiter, storm], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if storm.done():
            storm.result()  # an agent failed: raise its error
        peak_rss = rss_mib(proc.pid)
        storm_cpu = cpu_secs(proc.pid) - cpu_begun
        own_cpu = time.process_time() - own_cpu_begun
        others_storm, steal_storm = others_share(
            machine_begun,
            MachineCpu.now(),
            storm_cpu + own_cpu + cpu_secs(poller.pid) - poller_cpu_begun,
            time.perf_counter() - begun,
        )
        kernel_now = kernel_counters()
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
            state_p50=percentile_ms(samples["state"], 0.5),
            state_p99=percentile_ms(samples["state"], 0.99),
            base_p50=percentile_ms(samples["baseline"], 0.5),
            base_p99=percentile_ms(samples["baseline"], 0.99),
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

        begun, cpu_begun = time.perf_counter(), cpu_secs(proc.pid)
        counts = await asyncio.gather(*(rank_init(rank, stream) for rank, stream in enumerate(streams)))
        elapsed, cpu = time.perf_counter() - begun, cpu_secs(proc.pid) - cpu_begun
        ops = sum(counts)
    finally:
        for stream in streams:
            stream.close()
        code = await end_process(proc)  # no join: SIGTERM aborts the window (a failed verdict is expected)
        drain.cancel()
    baseline = await baseline_round_trips(ranks, max(1, ops // ranks))
    return StoreStormResult(ops, ops / elapsed, baseline, cpu, code)


# --- main ------------------------------------------------------------------------------------------


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
            print(table([row]).splitlines()[-1], flush=True)
            print(f"  {machine_line(row)}", flush=True)
        print()
        print(table(rows))
        for row in rows:
            print(f"{row.agents:,} agents: {machine_line(row)}")
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
        for proc in CHILDREN:
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
        PROFILE.append(options.profile_controller)
    import atexit

    atexit.register(kill_children_now)
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
        kill_children_now()
        sys.exit(130)
