"""Bounded soak of the controller on loopback: many runs, walk-ins coming and going, pollers, kills.

Run: ``.venv/bin/python bench/soak.py`` (options: ``--runs 50 --hosts 4 --leavers 2 --pollers 4
--kill-rate 0.3 --real-runs 4 --seed 1``; ``--quick`` = 10 protocol runs and 2 real ones).

A child process hosts the controllers, one run after another on the same port (``--controller-loop``
role), so its RSS and descriptor count are the controller's alone. The driver (this process) plays the
agents at protocol level. A "kill" is what the controller sees when an agent is SIGKILLed while a run
trains: the join link ends without the host's rank reports. It is sent as a TCP reset (SO_LINGER 0),
which docs/join-window.md counts as a *lost* link, so the run must fail. Each run:

1. `--leavers` walk-ins join with one rank each, then leave before the window closes (their ranks are
   retracted);
2. `--hosts` walk-ins join with one rank each, so the window closes at its target and WorldFormed
   ships;
3. with probability `--kill-rate`, one host is killed. Otherwise every host reports its rank exit 0 and
   closes its link;
4. the controller's verdict is compared with the expected one (done, or failed after a kill).

Then `--real-runs` runs use real processes: two agents of the program below (one gloo rank each, a
relay each), all-reducing in a loop. With probability `--kill-rate` a random agent is SIGKILLed while
its rank trains (expected verdict: failed), otherwise the ranks finish (done). After each real run,
no process of it may be left (found through an environment marker).

With `--daemon` the soak drives the real `flodld serve` process instead (the service: one port for its
whole life, one run after another, nothing restarted between runs): `--runs` protocol runs as above
(walk-ins, leavers, kills, pollers), each verdict read back from state.json `history`, the daemon's RSS
and descriptors sampled after every run, and a SIGTERM at the end that must exit 0.
``.venv/bin/python bench/soak.py --daemon --runs 200``.

Meanwhile `--pollers` tasks GET /state.json in a loop. The soak prints runs completed, verdict
correctness, the controller's RSS and descriptors after each run (first, max, last: no growth across
runs), and p50/p99 latencies of state.json, of a join (dial to Accept) and of a run. It also prints the
ratio of the state.json p99 under soak to a quiet baseline taken from the same controller before the
first run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.net.stream import FramedStream, open_channel
from flodld.wire.join import JOIN_PROTOCOL_VERSION as PROTOCOL_VERSION
from flodld.wire.join import Accept, Hello, RankExited, WorldFormed
from flodld.wire.magic import Channel
from flodld.wire.salt import new_salt, salt_from_hex, salt_to_hex

RUN_BOUND_SECS = 30.0
REAL_RUN_BOUND_SECS = 120.0
REAL_HOSTS = 2
ORPHAN_BOUND_SECS = 10.0
MARK = "FLODL_SOAK_MARK"
PROGRAM = """
import os, sys, time
import flodld

def main():
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    for step in range(int(os.environ["SOAK_STEPS"])):
        value = torch.ones(1)
        dist.all_reduce(value)
        print(f"soak-rank {dist.get_rank()} step {step}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(flodld.run(main))
"""


# --- the controller side (child process) ---------------------------------------------------------


def controller_options(port: int, hosts: int, salt_hex: str, index: int) -> ControllerOptions:
    return ControllerOptions.model_validate(
        {
            "bind_host": "127.0.0.1",
            "port": port,
            "capacity": hosts,
            "run_id": f"soak-{index}",
            "tick_interval": 0.02,
            "join": JoinConfig(
                target_ranks=hosts, min_rank_start=hosts, join_timeout=REAL_RUN_BOUND_SECS, token=salt_hex
            ),
            "env": {"OMP_NUM_THREADS": "1"},
        }
    )


async def controller_loop(port: int, runs: int, real_runs: int, hosts: int, salt_hex: str) -> None:
    """Host the runs' controllers in turn on `port`; report READY/RESULT lines on stdout."""
    from flodld.controller.dataplane import attach_data_plane
    from flodld.controller.run import Controller

    loop = asyncio.get_running_loop()
    for index in range(runs + real_runs + 1):  # run 0 is the quiet baseline
        size = REAL_HOSTS if index > runs else hosts
        controller = Controller(controller_options(port, size, salt_hex, index))
        attach_data_plane(controller)
        await controller.start()
        print(f"READY {index}", flush=True)
        if index == 0:
            await loop.run_in_executor(None, sys.stdin.readline)  # the driver measures the quiet baseline
            await controller.stop("baseline measured")
        else:
            result = await controller.wait()
            await controller.close()
            print(f"RESULT {index} {result.verdict.value} {json.dumps(result.reason)}", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # the driver sampled RSS/fds; next run


# --- the driver ----------------------------------------------------------------------------------


@dataclass
class Figures:
    state_latency: list[float] = field(default_factory=list)
    join_latency: list[float] = field(default_factory=list)
    run_latency: list[float] = field(default_factory=list)
    real_run_latency: list[float] = field(default_factory=list)
    kill_to_verdict: list[float] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    verdicts_right: int = 0
    verdicts_wrong: list[str] = field(default_factory=list)


def hello(host: str) -> Hello:
    return Hello(
        host=host,
        devices=["cpu:0"],
        device_labels=[],
        variant="cpu",
        torch_version="2.13",
        protocol_version=PROTOCOL_VERSION,
    )


async def get_state(port: int) -> float:
    begun = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /state.json HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
    response = await reader.read(-1)
    writer.close()
    if not response.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"state.json answered {response[:60]!r}")
    return time.perf_counter() - begun


async def poll(port: int, figures: Figures, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            figures.state_latency.append(await get_state(port))
        except (OSError, RuntimeError):
            await asyncio.sleep(0.01)  # between runs the port is briefly closed
        await asyncio.sleep(0.005)


async def join(port: int, key: bytes, host: str, figures: Figures) -> FramedStream:
    begun = time.perf_counter()
    stream = await open_channel("127.0.0.1", port, Channel.JOIN, key, timeout=10)
    await stream.send(hello(host))
    reply = (await stream.recv(10)).message()
    if not isinstance(reply, Accept):
        raise RuntimeError(f"{host} was refused: {reply!r}")
    figures.join_latency.append(time.perf_counter() - begun)
    return stream


def reset(stream: FramedStream) -> None:
    """Close with a TCP reset, as the kernel does for a killed process with unread data."""
    sock = stream.writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.writer.transport.abort()


async def one_run(
    port: int, key: bytes, args: argparse.Namespace, rng: random.Random, figures: Figures, index: int
) -> str:
    """Drive one run; returns the expected verdict."""
    begun = time.perf_counter()
    leavers = [await join(port, key, f"leaver-{index}-{i}", figures) for i in range(args.leavers)]
    for stream in leavers:
        await stream.aclose()
    await asyncio.sleep(0.05)  # let the retractions land before the members fill the target
    members = await asyncio.gather(
        *(join(port, key, f"host-{index}-{i}", figures) for i in range(args.hosts))
    )
    formed = [(await stream.recv(RUN_BOUND_SECS)).message() for stream in members]
    if not all(isinstance(message, WorldFormed) for message in formed):
        raise RuntimeError(f"run {index}: expected WorldFormed everywhere, got {formed!r}")
    kill = rng.random() < args.kill_rate
    victim = rng.randrange(args.hosts) if kill else -1
    for position, (stream, message) in enumerate(zip(members, formed, strict=True)):
        assert isinstance(message, WorldFormed)
        if position == victim:
            reset(stream)
            continue
        for rank in message.envelope.ranks:
            await stream.send(RankExited(rank=rank, code=0))
        await stream.aclose()
    figures.run_latency.append(time.perf_counter() - begun)
    return "failed" if kill else "done"


def marked_pids(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if (
                entry.isdigit()
                and needle in Path(f"/proc/{entry}/environ").read_bytes()
                and "\nState:\tZ" not in Path(f"/proc/{entry}/status").read_text()
            ):
                found.append(int(entry))
        except OSError:
            continue
    return found


async def real_run(
    port: int,
    salt_hex: str,
    program: Path,
    args: argparse.Namespace,
    rng: random.Random,
    figures: Figures,
    index: int,
    child: subprocess.Popen[str],
) -> tuple[str, list[str]]:
    """Two real agents; maybe SIGKILL one mid-training. Returns the expected verdict and the RESULT line."""
    from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec

    mark = f"{os.getpid()}-{index}"
    begun = time.perf_counter()
    agents = []
    for position in range(REAL_HOSTS):
        spec = AgentSpec(
            host=f"real-{index}-{position}",
            controller_host="127.0.0.1",
            controller_port=port,
            salt_hex=salt_hex,
            devices=["cpu"],
            grace_secs=2.0,
        )
        env = {
            **os.environ,
            AGENT_ENV: encode_spec(spec),
            MARK: mark,
            "SOAK_STEPS": "40",
            "OMP_NUM_THREADS": "1",
            "FLODL_NET_TIMEOUT_SCALE": "0.2",
        }
        agents.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(program),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
    kill = rng.random() < args.kill_rate
    victim = agents[rng.randrange(REAL_HOSTS)]
    assert victim.stdout is not None
    async with asyncio.timeout(REAL_RUN_BOUND_SECS):
        while b"step 3" not in await victim.stdout.readline():
            pass
    killed_at = time.perf_counter()
    if kill:
        victim.kill()
    drains = [asyncio.ensure_future(agent.communicate()) for agent in agents]
    result = await asyncio.wait_for(expect(child, f"RESULT {index}"), REAL_RUN_BOUND_SECS)
    if kill:
        figures.kill_to_verdict.append(time.perf_counter() - killed_at)
    await asyncio.wait_for(asyncio.gather(*drains), REAL_RUN_BOUND_SECS)
    deadline = time.monotonic() + ORPHAN_BOUND_SECS
    while marked_pids(mark) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    left = marked_pids(mark)
    if left:
        figures.orphans.append(f"run {index}: pids {left}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    figures.real_run_latency.append(time.perf_counter() - begun)
    return ("failed" if kill else "done"), result


def sample(pid: int, figures: Figures) -> None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            figures.rss.append(int(line.split()[1]) * 1024)
    figures.fds.append(len(os.listdir(f"/proc/{pid}/fd")))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


async def expect(child: subprocess.Popen[str], prefix: str) -> list[str]:
    assert child.stdout is not None
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    if not line.startswith(prefix):
        raise RuntimeError(f"controller child said {line!r}, expected {prefix}")
    return line.split(" ", 3)


def advance(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("next\n")
    child.stdin.flush()


def fresh_endpoint() -> tuple[int, str, bytes]:
    """A free loopback port and a new join token for one soak: (port, token hex, token)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    salt_hex = salt_to_hex(new_salt())
    return port, salt_hex, salt_from_hex(salt_hex)


async def drive(args: argparse.Namespace) -> int:
    port, salt_hex, key = fresh_endpoint()
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--controller-loop",
            "--port",
            str(port),
            "--runs",
            str(args.runs),
            "--real-runs",
            str(args.real_runs),
            "--hosts",
            str(args.hosts),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "FLODL_SOAK_SALT": salt_hex},  # the salt never travels in argv
    )
    rng = random.Random(args.seed)
    figures = Figures()
    stop = asyncio.Event()
    scratch = tempfile.TemporaryDirectory(prefix="soak-")
    started = time.perf_counter()
    try:
        await expect(child, "READY 0")
        quiet = [await get_state(port) for _ in range(200)]
        advance(child)
        sample(child.pid, figures)
        advance(child)
        pollers = [asyncio.ensure_future(poll(port, figures, stop)) for _ in range(args.pollers)]
        program = Path(scratch.name) / "soak_program.py"
        program.write_text(PROGRAM)
        for index in range(1, args.runs + args.real_runs + 1):
            await expect(child, f"READY {index}")
            if index > args.runs:
                expected, result = await real_run(port, salt_hex, program, args, rng, figures, index, child)
                _, _, verdict, reason = result
            else:
                expected = await asyncio.wait_for(
                    one_run(port, key, args, rng, figures, index), RUN_BOUND_SECS
                )
                _, _, verdict, reason = await asyncio.wait_for(
                    expect(child, f"RESULT {index}"), RUN_BOUND_SECS
                )
            if verdict == expected:
                figures.verdicts_right += 1
            else:
                figures.verdicts_wrong.append(
                    f"run {index}: expected {expected}, got {verdict} ({reason.strip()})"
                )
            sample(child.pid, figures)
            advance(child)
        stop.set()
        await asyncio.gather(*pollers)
    finally:
        child.kill()
        child.wait()
        scratch.cleanup()
    elapsed = time.perf_counter() - started
    report(args, figures, quiet, elapsed)
    return 0 if not figures.verdicts_wrong and not figures.orphans else 1


async def service_state(port: int) -> dict[str, Any] | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /state.json HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
    response = await reader.read(-1)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    loaded: dict[str, Any] = json.loads(body)
    return loaded


def _waiting(run_id: str, state: dict[str, Any]) -> bool:
    """The window of run `run_id` is open."""
    return bool(state.get("run_id") == run_id and state.get("phase") == "waiting")


def _in_history(run_id: str, state: dict[str, Any]) -> bool:
    """Run `run_id` has ended (it is in the history)."""
    return any(entry.get("run_id") == run_id for entry in state.get("history") or [])


async def until_state(port: int, predicate: Callable[[dict[str, Any]], bool], bound: float) -> dict[str, Any]:
    deadline = time.monotonic() + bound
    while True:
        with contextlib.suppress(OSError):
            state = await service_state(port)
            if state is not None and predicate(state):
                return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"state.json never showed the expected state within {bound:g}s")
        await asyncio.sleep(0.01)


async def drive_daemon(args: argparse.Namespace) -> int:
    """`--runs` protocol runs through one real `flodld serve` process (the service)."""
    port, salt_hex, key = fresh_endpoint()
    scratch = tempfile.TemporaryDirectory(prefix="soak-daemon-")
    config = Path(scratch.name) / "fdl.yml"
    config.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n    join:\n      discovery: true\n      "
        f"min_rank_start: {args.hosts}\n      target_ranks: {args.hosts}\n      join_timeout: "
        f"{RUN_BOUND_SECS}\n      token: {salt_hex}\n  workers: []\n"
    )
    log = open(Path(scratch.name) / "daemon.log", "w")  # noqa: SIM115 - lives as long as the daemon
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flodld",
            "serve",
            "--config",
            str(config),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--run-id",
            "soak",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rng = random.Random(args.seed)
    figures = Figures()
    stop = asyncio.Event()
    started = time.perf_counter()
    code = None
    try:
        await until_state(port, lambda s: s.get("phase") == "waiting", 30)
        quiet = [await get_state(port) for _ in range(200)]
        sample(daemon.pid, figures)  # baseline: the first window open, nothing joined
        pollers = [asyncio.ensure_future(poll(port, figures, stop)) for _ in range(args.pollers)]
        for index in range(1, args.runs + 1):
            await until_state(
                port,
                functools.partial(_waiting, f"soak-{index}"),
                RUN_BOUND_SECS,
            )
            expected = await asyncio.wait_for(one_run(port, key, args, rng, figures, index), RUN_BOUND_SECS)
            state = await until_state(
                port,
                functools.partial(_in_history, f"soak-{index}"),
                RUN_BOUND_SECS,
            )
            entry = next(h for h in state["history"] if h["run_id"] == f"soak-{index}")
            if entry["verdict"] == expected:
                figures.verdicts_right += 1
            else:
                figures.verdicts_wrong.append(
                    f"run {index}: expected {expected}, got {entry['verdict']} ({entry['reason']})"
                )
            sample(daemon.pid, figures)
        stop.set()
        await asyncio.gather(*pollers)
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(30)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()
        scratch.cleanup()
    elapsed = time.perf_counter() - started
    args.real_runs = 0
    report(args, figures, quiet, elapsed)
    print(f"flodld serve: one process for all {args.runs} runs; SIGTERM at the end exited {code}")
    return 0 if not figures.verdicts_wrong and code == 0 else 1


def report(args: argparse.Namespace, figures: Figures, quiet: list[float], elapsed: float) -> None:
    ms = 1e3
    runs = figures.verdicts_right + len(figures.verdicts_wrong)
    print(
        f"soak: {runs} runs completed in {elapsed:.1f}s ({args.runs} protocol runs of {args.hosts} hosts + "
        f"{args.leavers} leavers, {args.real_runs} real runs of {REAL_HOSTS} agents; {args.pollers} pollers, "
        f"kill rate {args.kill_rate})"
    )
    print(f"verdicts: {figures.verdicts_right}/{runs} correct")
    for wrong in figures.verdicts_wrong[:10]:
        print(f"  WRONG {wrong}")
    rss_mib = [value / 2**20 for value in figures.rss]
    print(
        f"controller RSS MiB: baseline {rss_mib[0]:.1f}, first run {rss_mib[1]:.1f}, max {max(rss_mib):.1f}, "
        f"last {rss_mib[-1]:.1f}"
    )
    print(
        f"controller fds: baseline {figures.fds[0]}, first run {figures.fds[1]}, max {max(figures.fds)}, "
        f"last {figures.fds[-1]}"
    )
    protocol = figures.rss[1 : args.runs + 1]  # sample 0 is the baseline; real runs come last
    head, tail = protocol[:5], protocol[-5:]
    growth = (statistics.mean(tail) - statistics.mean(head)) / 2**20
    print(
        f"RSS growth over the protocol runs, mean of the last 5 minus the first 5: {growth:+.1f} MiB; "
        f"fd growth over all runs {figures.fds[-1] - figures.fds[1]:+d}"
    )
    marks = sorted({1, *(max(1, round(args.runs * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0))})
    print(
        "RSS MiB after protocol run "
        + ", ".join(f"{m}: {figures.rss[m] / 2**20:.1f}" for m in marks if m < len(figures.rss))
    )
    if args.real_runs >= 2:
        real = [value / 2**20 for value in figures.rss[args.runs + 1 :]]
        print(f"RSS after each real run (data plane included), MiB: {', '.join(f'{v:.1f}' for v in real)}")
    print(
        f"orphan processes after real runs: {len(figures.orphans)}"
        + "".join(f"\n  ORPHANS {line}" for line in figures.orphans)
    )
    for name, values in (
        ("state.json", figures.state_latency),
        ("join", figures.join_latency),
        ("run", figures.run_latency),
        ("real run", figures.real_run_latency),
        ("kill->verdict", figures.kill_to_verdict),
    ):
        if not values:
            continue
        print(
            f"{name:>13}: n={len(values):5d} p50 {percentile(values, 0.5) * ms:8.2f} ms  "
            f"p99 {percentile(values, 0.99) * ms:8.2f} ms  max {max(values) * ms:8.2f} ms"
        )
    quiet_p99 = percentile(quiet, 0.99)
    print(
        f"state.json p99 under soak / quiet baseline p99 ({quiet_p99 * ms:.2f} ms): "
        f"{percentile(figures.state_latency, 0.99) / quiet_p99:.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--leavers", type=int, default=2)
    parser.add_argument("--pollers", type=int, default=4)
    parser.add_argument("--kill-rate", type=float, default=0.3)
    parser.add_argument("--real-runs", type=int, default=4, help="runs with real agent/relay/rank processes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="10 runs")
    parser.add_argument("--daemon", action="store_true", help="drive the real `flodld serve` service process")
    parser.add_argument("--controller-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.real_runs = 10, 2
    if args.controller_loop:
        import logging

        logging.disable(logging.WARNING)
        asyncio.run(
            controller_loop(args.port, args.runs, args.real_runs, args.hosts, os.environ["FLODL_SOAK_SALT"])
        )
        return 0
    return asyncio.run(drive_daemon(args) if args.daemon else drive(args))


if __name__ == "__main__":
    sys.exit(main())
