"""Join storm: N simulated agents join one `flodld serve` at once; how does the controller hold up?

    .venv/bin/python bench/join_storm.py [--agents 1000] [--pollers 8]

Prints admissions/s (against a same-run baseline: bare TCP connect + echo round trips on a
plain asyncio server, the cost floor of any per-connection handshake), the time from the last
hello to the last WorldFormed, p50/p99 state.json latency while polled concurrently during the
storm (against the same HTTP path answering a 404, which skips the snapshot), and the
controller's resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flodld.net.stream import open_channel
from flodld.wire.frames import PROTOCOL_VERSION
from flodld.wire.join import Accept, Hello, RankExited, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt

_PORT = re.compile(rb"event=listening bind=\S+ port=(\d+)")


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


async def _baseline_connects(count: int) -> float:
    """Connections/s for connect + 24-byte echo round trip on a bare asyncio server."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(24))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * 24)
        await reader.readexactly(24)
        writer.close()

    begun = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - begun
    server.close()
    return count / elapsed


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

    A separate process, so the agents' own event-loop load does not inflate the latencies."""
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


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


async def main(agents: int, pollers: int) -> None:
    _raise_fd_limit(4 * agents + 256)
    token = new_salt()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flodld", "serve", "--port", "0", "--bind", "127.0.0.1", "--ranks", str(agents),
        "--token", token.hex(), "--window", "600", stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    while True:
        line = await proc.stderr.readline()
        if not line:
            raise SystemExit("flodld serve exited before listening")
        found = _PORT.search(line)
        if found:
            port = int(found.group(1))
            break
    drain = asyncio.create_task(proc.stderr.read())  # keep the log pipe from filling up
    baseline_rate = await _baseline_connects(agents)
    idle_rss = _rss_mib(proc.pid)

    poller = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--poller-for", str(port), "--pollers", str(pollers),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert poller.stdout is not None
    await poller.stdout.readline()  # the storm starts once the pollers are running

    accepted_at: list[float] = []
    formed_at: list[float] = []
    everyone_formed = asyncio.Event()
    release = asyncio.Event()

    async def agent(index: int) -> None:
        stream = await open_channel("127.0.0.1", port, Channel.JOIN, token, timeout=60)
        await stream.send(Hello(host=f"bench-{index:05d}", devices=["cpu:0"], device_labels=[], variant="cpu",
                                torch_version="bench", protocol_version=PROTOCOL_VERSION))
        reply = (await stream.recv(60)).message()
        assert isinstance(reply, Accept), reply
        accepted_at.append(time.perf_counter())
        world = await stream.recv(120)  # authenticated; decoding its O(world) host list is the agent's cost
        assert world.kind == WorldFormed.KIND, world.kind
        formed_at.append(time.perf_counter())
        if len(formed_at) == agents:
            everyone_formed.set()
        await release.wait()  # links stay open: RSS at its peak, and the run (and port) outlive the polling
        for rank in reply.ranks:  # nobody renumbers in a storm without departures: Accept's ranks are final
            await stream.send(RankExited(rank=rank, code=0))
        await stream.aclose()

    begun = time.perf_counter()
    storm = asyncio.gather(*(agent(i) for i in range(agents)))
    await everyone_formed.wait()
    peak_rss = _rss_mib(proc.pid)
    polled, _ = await poller.communicate(b"")
    release.set()
    await storm
    samples = json.loads(polled)
    state_samples, baseline_samples = samples["state"], samples["baseline"]
    admit_rate = agents / (max(accepted_at) - begun)
    code = await asyncio.wait_for(proc.wait(), 60)
    await drain

    state_p50, state_p99 = _pct(state_samples, 0.5), _pct(state_samples, 0.99)
    base_p50, base_p99 = _pct(baseline_samples, 0.5), _pct(baseline_samples, 0.99)
    print(f"join storm: {agents} agents, {pollers} state.json pollers, controller exit {code}")
    print(f"  admissions/s          {admit_rate:10.1f}   baseline TCP connect+echo/s {baseline_rate:10.1f}"
          f"   ratio {admit_rate / baseline_rate:6.3f}")
    print(f"  last hello -> formed  {(max(formed_at) - max(accepted_at)) * 1000:10.1f} ms")
    print(f"  state.json p50/p99    {state_p50:7.1f} / {state_p99:7.1f} ms ({len(state_samples)} polls)"
          f"   404 baseline p50/p99 {base_p50:7.1f} / {base_p99:7.1f} ms   p50 ratio {state_p50 / base_p50:6.2f}")
    print(f"  controller RSS        {idle_rss:7.1f} MiB idle, {peak_rss:7.1f} MiB with every host linked")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--pollers", type=int, default=8)
    parser.add_argument("--poller-for", type=int, help=argparse.SUPPRESS)  # internal: run as the poller child
    options = parser.parse_args()
    entry = (
        poller_main(options.poller_for, options.pollers) if options.poller_for else main(options.agents, options.pollers)
    )
    try:
        import uvloop
    except ImportError:
        asyncio.run(entry)
    else:
        uvloop.run(entry)
