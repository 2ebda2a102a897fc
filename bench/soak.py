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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The simulated agents and state.json probes, and the figures and their report, are modules of their own
# beside this one.
from soak_agents import (
    RUN_BOUND_SECS,
    fresh_endpoint,
    get_state,
    in_history,
    one_run,
    poll,
    until_state,
    window_open,
)
from soak_figures import Figures, report, sample

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions

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
    from flodld.controller.attachplane import attach_data_plane
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
    report(args, figures, quiet, elapsed, REAL_HOSTS)
    return 0 if not figures.verdicts_wrong and not figures.orphans else 1


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
                functools.partial(window_open, f"soak-{index}"),
                RUN_BOUND_SECS,
            )
            expected = await asyncio.wait_for(one_run(port, key, args, rng, figures, index), RUN_BOUND_SECS)
            state = await until_state(
                port,
                functools.partial(in_history, f"soak-{index}"),
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
    report(args, figures, quiet, elapsed, REAL_HOSTS)
    print(f"flodld serve: one process for all {args.runs} runs; SIGTERM at the end exited {code}")
    return 0 if not figures.verdicts_wrong and code == 0 else 1


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
