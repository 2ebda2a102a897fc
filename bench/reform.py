"""Re-formation: how long a world of N hosts takes to form again after one rank fails.

    .venv/bin/python bench/reform.py [--hosts 1000] [--rounds 3]

One `flodld serve` (a service: after a run's verdict it opens the next run's window on the same port,
which is what a restart of `fdl run --max-restarts` does with its walk-ins) and N simulated agents
(`storm_harness.LeanAgent`: the real join protocol and crypto, one asyncio protocol each). Per round:
every agent joins and gets WorldFormed; then host 0 reports its rank exited with code 1 (the failure),
which fails the run. From the moment that report is sent, every agent behaves as a persist loop whose
back-off was reset: it leaves at the Abort (or its link's end) and dials again at once, until admitted;
host 0 is replaced by a new host name (a fresh box). The figure is the time from the failure's report
to the last WorldFormed of the next run, with its parts: the failure to the last Abort (every host
knows), and from there to the last WorldFormed (the new window's admissions and formation).
The issue's goal: <= 2 s for 1,000 hosts. Rounds follow each other on the same service.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from storm_harness import LeanAgent, end_process, quiet_collector, raise_fd_limit, start_controller

from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Abort, Hello, RankExited
from flodld.wire.salt import new_salt

RETRY_SECS = 0.01


class ReformingAgent(LeanAgent):
    """A LeanAgent that also notices the run's end (Abort, or its link closing) after it formed."""

    def __init__(self, key: bytes, hello: Hello) -> None:
        super().__init__(key, hello)
        self.ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return  # left: what still arrives on the closing link is not read
        if not self.formed.done():
            try:
                super().data_received(data)
            except WireError:  # a link the controller ended mid-read: this dial failed, the loop dials again
                assert self.transport is not None
                self.transport.close()
                return
            if not self.formed.done():
                return
            data = b""  # frames after WorldFormed in the same read stay in the connection's buffer
        conn = self.conn
        if data:  # (receive_data(b"") would mean the end of the stream)
            conn.receive_data(data)
        while isinstance(event := conn.next_event(), Frame):
            if isinstance(event.message(), Abort) and not self.ended.done():
                self.ended.set_result(time.perf_counter())
                assert self.transport is not None
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for waiter in (self.accepted, self.formed):
            if not waiter.cancelled():
                waiter.exception()  # retrieved: a failed dial is retried by `_formed_agent`, not reported
        if not self.ended.done():
            self.ended.set_result(time.perf_counter())


async def _formed_agent(key: bytes, host: str, port: int) -> tuple[ReformingAgent, list[int], float]:
    """Dial until admitted and formed (a window not yet open refuses or closes: dial again)."""
    loop = asyncio.get_running_loop()
    hello = Hello(
        host=host,
        devices=["cpu:0"],
        device_labels=[],
        variant="cpu",
        torch_version="bench",
        protocol_version=JOIN_PROTOCOL_VERSION,
    )
    while True:
        agent: ReformingAgent | None = None
        try:
            _, agent = await loop.create_connection(lambda: ReformingAgent(key, hello), "127.0.0.1", port)
            accept = await asyncio.wait_for(agent.accepted, 120)
            await asyncio.wait_for(agent.formed, 300)
            return agent, list(accept.ranks), time.perf_counter()
        except (AssertionError, ConnectionError, OSError):
            for waiter in (agent.accepted, agent.formed) if agent is not None else ():
                if waiter.done() and not waiter.cancelled():
                    waiter.exception()  # seen: a refused dial is retried, not an unretrieved error
            await asyncio.sleep(RETRY_SECS)


async def _redial(
    agent: ReformingAgent, key: bytes, host: str, port: int, *, first: bool
) -> tuple[ReformingAgent, list[int], float]:
    """A persist loop: dial again the moment the agent's run ended (the failed host's replacement at once)."""
    if not first:
        await agent.ended
    return await _formed_agent(key, host, port)


async def reform(hosts: int, rounds: int) -> list[tuple[float, float, float]]:
    raise_fd_limit(2 * hosts + 1024)
    token = new_salt()
    flags = ("--ranks", str(hosts), "--token", token.hex(), "--window", "600")
    proc, port, drain = await start_controller(*flags, once=False)
    results: list[tuple[float, float, float]] = []
    try:
        quiet_collector()
        names = [f"bench-{index:05d}" for index in range(hosts)]
        formed = await asyncio.gather(*(_formed_agent(token, name, port) for name in names))
        for round_number in range(rounds):
            agents = [agent for agent, _, _ in formed]
            failed_ranks = formed[0][1]
            failed_at = time.perf_counter()
            agents[0].leave([RankExited(rank=rank, code=1) for rank in failed_ranks])
            names[0] = f"bench-replacement-{round_number}"

            ended = asyncio.gather(*(agent.ended for agent in agents[1:]))
            redials = [
                _redial(agent, token, name, port, first=not i)
                for i, (agent, name) in enumerate(zip(agents, names, strict=True))
            ]
            formed = await asyncio.gather(*redials)
            last_end = max(await ended)
            last_formed = max(at for _, _, at in formed)
            results.append((last_formed - failed_at, last_end - failed_at, last_formed - last_end))
            told, rest = last_end - failed_at, last_formed - last_end
            print(
                f"round {round_number + 1}: {hosts} hosts formed again {last_formed - failed_at:.3f} s after "
                f"the failure (every host told in {told:.3f} s, then {rest:.3f} s to the last WorldFormed)",
                flush=True,
            )
        for agent, _, _ in formed:
            agent.close()
    finally:
        await end_process(proc)
        drain.cancel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = asyncio.run(reform(args.hosts, args.rounds))
    totals = [total for total, _, _ in results]
    print(
        f"re-formation of {args.hosts} hosts: median {statistics.median(totals):.3f} s "
        f"(spread {min(totals):.3f}-{max(totals):.3f} s over {len(totals)} rounds; goal <= 2 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
