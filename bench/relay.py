"""The relay data plane: `all_average` against gloo `all_reduce` on the same bytes, in one run.

Run: ``.venv/bin/python bench/relay.py`` (options: ``--ranks 2,4 --sizes 1,16,64 --runs 5 --hosts 1,2``).

For each world size it starts ``fdl run --ranks N`` on this machine (embedded default: controller,
one agent, one relay, N CPU ranks, ``cpu_sync``) with this file as the program. Every rank, per size
(MiB of float32), takes turns between ``all_average([t])`` (rank → relay → rank, every hop encrypted:
the world has one host, so its relay broadcasts its own fold; a world of several hosts adds the relay →
controller → relay hops) and ``dist.all_reduce(t)`` (gloo, cleartext, rank to rank), with a barrier before
each call, and times the slowest rank; medians are printed with their ratio and the per-rank
throughput of ``all_average`` (bytes of the tensor / time).

``--hosts 2`` measures the multi-host road on the same machine: ``fdl run`` serves a walk-in window and
two ``fdl join`` walk-ins (hosts ``bench-a``, ``bench-b``) bring N/2 ranks each, so every round goes
rank → relay → controller → relay → rank (four encrypted hops).

In the same run the parent measures:
- the asyncio loopback ceiling: one asyncio stream pair in two processes moving the same bytes
  (write 4 MiB chunks, readexactly on the other side), GiB/s;
- the cipher: AES-256-GCM (or ChaCha20-Poly1305, whatever this CPU negotiates) seal and open rates
  on the same sizes, and from them the cipher's share of an ``all_average``: the seals and opens of the
  tensor's bytes on a round's critical path (a rank seals its deposit, the relay opens every rank's
  deposit and seals the result once per rank, a rank opens it: 1 + N seals and N + 1 opens; with
  several hosts add the relay → controller → relay hops: 2 seals and 2 opens more), timed
  with the rates measured here, over the measured latency. This is an estimate of what a null cipher
  would save; no null cipher exists in flodld.

Two relay roads in the same world, in turn with gloo: ``all_average`` takes the same-host shared-memory
road between ranks and their relay when ``FLODL_SHM`` allows it (the default; the table says which road
it took), ``framed`` is the same call with the rank's client told to deposit framed (every byte sealed
on the loopback legs: the reference road). On the shared-memory road no tensor byte is sealed on a
rank ⇄ relay leg, so its cipher share counts only the relay → controller → relay hops of a multi-host
world (2 seals, 2 opens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MIB = 1024 * 1024


# --- the rank side (runs under fdl run) -------------------------------------------------------------


def _rank_main() -> int:
    from flodld.launcher import exit_if_worker_role

    exit_if_worker_role()
    import torch
    import torch.distributed as dist

    import flodld
    from flodld.rank.averaging import all_average
    from flodld.rank.relay_client import relay_client

    sizes = [int(part) for part in os.environ["BENCH_RELAY_SIZES"].split(",")]
    runs = int(os.environ["BENCH_RELAY_RUNS"])
    out = Path(os.environ["BENCH_RELAY_OUT"])

    def main() -> int:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        results: dict[str, dict[str, float]] = {}
        client = relay_client()
        for size in sizes:
            tensor = torch.full((size * MIB // 4,), float(rank + 1), dtype=torch.float32)
            samples: dict[str, list[float]] = {"all_average": [], "framed": [], "all_reduce": []}
            for index in range(1 + runs):  # one warm-up round
                for name in samples:
                    work = tensor.clone()
                    client.use_shm = name == "all_average"
                    dist.barrier()
                    begun = time.perf_counter()
                    if name in ("all_average", "framed"):
                        (result,) = all_average([work])
                    else:
                        dist.all_reduce(work)
                        result = work
                    elapsed = torch.tensor([time.perf_counter() - begun], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if index:
                        samples[name].append(float(elapsed))
                    expected = sum(range(1, world + 1)) / (1 if name == "all_reduce" else world)
                    assert float(result[0]) == expected and float(result[-1]) == expected, (name, result[:2])
            results[str(size)] = {name: statistics.median(values) for name, values in samples.items()}
            results[str(size)]["shm"] = float(client.region is not None)
        if rank == 0:
            out.write_text(json.dumps(results))
        return 0

    return int(flodld.run(main) or 0)


# --- the parent ------------------------------------------------------------------------------------


def _loopback_child(port: int, total: int) -> None:
    import asyncio

    async def run() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chunk = bytes(4 * MIB)
        sent = 0
        while sent < total:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        await reader.read(1)
        writer.close()

    asyncio.run(run())


def loopback_ceiling(total: int = 512 * MIB) -> float:
    """GiB/s of one asyncio stream from a child process to this one (readexactly of 4 MiB units)."""
    import asyncio

    result: list[float] = []

    async def run() -> None:
        done = asyncio.Event()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            begun = time.perf_counter()
            received = 0
            while received < total:
                received += len(await reader.readexactly(4 * MIB))
            result.append(received / (time.perf_counter() - begun) / 2**30)
            writer.write(b"k")
            await writer.drain()
            writer.close()
            done.set()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        child = subprocess.Popen([sys.executable, __file__, "--loopback-child", str(port), str(total)])
        await done.wait()
        server.close()
        await asyncio.get_running_loop().run_in_executor(None, child.wait)

    asyncio.run(run())
    return result[0]


def cipher_rates(size: int) -> tuple[str, float, float]:
    """(suite, seal GiB/s, open GiB/s) of this build's negotiated AEAD on `size` bytes, in place."""
    from flodld.wire.aead import Suite, aead_for, cpu_has_aes, open_in_place, seal_in_place

    suite = Suite.AES_256_GCM if cpu_has_aes() else Suite.CHACHA20_POLY1305
    aead = aead_for(suite, bytes(32))
    buffer = bytearray(os.urandom(size) + bytes(16))
    view = memoryview(buffer)
    seal, open_ = [], []
    for index in range(5):
        nonce = index.to_bytes(12, "little")
        begun = time.perf_counter()
        seal_in_place(aead, nonce, view, size, b"h" * 24)
        seal.append(time.perf_counter() - begun)
        begun = time.perf_counter()
        open_in_place(aead, nonce, view, size, b"h" * 24)
        open_.append(time.perf_counter() - begun)
    return suite.name, size / min(seal) / 2**30, size / min(open_) / 2**30


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _walk_in_world(ranks: int, hosts: int, scratch: str, env: dict[str, str]) -> None:
    """`fdl run` serving a walk-in window of `ranks` ranks, and `hosts` `fdl join` walk-ins on this box."""
    import secrets

    if ranks % hosts:
        raise SystemExit(f"--hosts {hosts} needs a rank count it divides, not {ranks}")
    port, token = _free_port(), secrets.token_hex(16)
    (Path(scratch) / "fdl.yml").write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n"
        f"    port: {port}\n    averaging: cpu_sync\n    backend: gloo\n    join:\n"
        f"      discovery: true\n      min_rank_start: {ranks}\n      target_ranks: {ranks}\n"
        f"      join_timeout: 120\n      token: {token}\n  workers: []\n"
    )
    program = str(Path(__file__).resolve())
    fdl = [sys.executable, "-m", "fdl.main"]
    logs = Path(scratch) / "logs"
    logs.mkdir()
    with (logs / "run.log").open("w") as sink:
        run = subprocess.Popen([*fdl, "run", "--project", scratch, program], cwd=scratch, env=env,
                               stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    time.sleep(3)  # the window opens
    joins = []
    for index in range(hosts):
        with (logs / f"join{index}.log").open("w") as sink:
            joins.append(subprocess.Popen(
                [*fdl, "join", f"127.0.0.1:{port}", "--bin", program, "--host", f"bench-{'ab'[index]}",
                 "--devices", f"cpu:{ranks // hosts}", "--", "--rank"],
                cwd=scratch, env={**env, "FDL_JOIN_TOKEN": token},
                stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
    try:
        codes = [process.wait(timeout=1800) for process in [*joins, run]]
    finally:
        for process in [*joins, run]:  # none outlives the bench (a failed join leaves the window open)
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(codes):
        text = "\n".join(path.read_text()[-2000:] for path in sorted(logs.iterdir()))
        raise SystemExit(f"walk-in world of {hosts} hosts failed {codes}:\n{text}")


def run_world(ranks: int, sizes: list[int], runs: int, hosts: int = 1) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "BENCH_RELAY_SIZES": ",".join(map(str, sizes)),
            "BENCH_RELAY_RUNS": str(runs),
            "BENCH_RELAY_OUT": str(out),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), str(REPO / "clients"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        for name in ("FLODL_INTERNAL_AGENT_JSON", "FLODL_INTERNAL_RELAY_JSON", "RANK", "FLODL_CONTROLLER"):
            env.pop(name, None)
        if hosts > 1:
            _walk_in_world(ranks, hosts, scratch, env)
            return json.loads(out.read_text())  # type: ignore[no-any-return]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fdl.main",
                "run",
                "--ranks",
                str(ranks),
                str(Path(__file__).resolve()),
                "--",
                "--rank",
            ],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(
                f"fdl run --ranks {ranks} failed "
                f"({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default="2", help="comma-separated world sizes (default 2)")
    parser.add_argument("--sizes", default="1,16,64", help="comma-separated tensor sizes in MiB")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds per size (after one warm-up)")
    parser.add_argument(
        "--hosts", default="1", help="comma-separated host counts: 1 (one relay) and/or 2 (walk-ins)"
    )
    options = parser.parse_args()
    sizes = [int(part) for part in options.sizes.split(",")]
    print(
        f"relay bench on {os.cpu_count()} CPU(s), sizes {sizes} MiB float32, {options.runs} runs (median)",
        flush=True,
    )
    ceiling = loopback_ceiling()
    print(f"asyncio loopback ceiling: {ceiling:.2f} GiB/s", flush=True)
    rates = {size: cipher_rates(size * MIB) for size in sizes}
    for size, (suite, seal, open_) in rates.items():
        print(f"cipher {suite} on {size} MiB: seal {seal:.2f} GiB/s, open {open_:.2f} GiB/s", flush=True)
    print()
    print(
        "| hosts | ranks | size | road | relay all_average | gloo all_reduce | ratio | framed all_average | "
        "framed ratio | per-rank throughput | vs loopback | cipher share (est.) | framed cipher share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worlds = [
        (hosts, ranks)
        for hosts in (int(part) for part in options.hosts.split(","))
        for ranks in (int(part) for part in options.ranks.split(","))
    ]
    for hosts, ranks in worlds:
        results = run_world(ranks, sizes, options.runs, hosts)
        for size in sizes:
            row = results[str(size)]
            average, reduce_, framed = row["all_average"], row["all_reduce"], row["framed"]
            shm = bool(row.get("shm"))
            throughput = size / 1024 / average  # GiB/s of the tensor per rank
            _, seal, open_ = rates[size]
            seals, opens = 1 + ranks, ranks + 1  # critical path: see the module docstring
            upstream = 2 if hosts > 1 else 0
            framed_cipher = (size / 1024) * ((seals + upstream) / seal + (opens + upstream) / open_)
            cipher = (size / 1024) * (upstream / seal + upstream / open_) if shm else framed_cipher
            road = "shm" if shm else "framed"
            print(
                f"| {hosts} | {ranks} | {size} MiB | {road} | {average * 1000:.1f} ms | "
                f"{reduce_ * 1000:.1f} ms | {average / reduce_:.1f}x | {framed * 1000:.1f} ms | "
                f"{framed / reduce_:.1f}x | {throughput * 1024:.0f} MiB/s | {throughput / ceiling:.0%} | "
                f"{min(cipher / average, 1):.0%} | {min(framed_cipher / framed, 1):.0%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--loopback-child":
        _loopback_child(int(sys.argv[2]), int(sys.argv[3]))
    elif "--rank" in sys.argv[1:]:
        sys.exit(_rank_main())
    else:
        sys.exit(main())
