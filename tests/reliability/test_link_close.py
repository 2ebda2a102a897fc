"""An agent's last reports reach the controller even when the path to it dies with the agent.

`fdl join --ssh` runs the agent through an ssh forward that is torn down (SIGTERM to the ssh client) as
soon as the agent exits. The agent wrote its last RankExited reports and closed the join link at once, so
a forward still carrying them dropped them, and a clean run failed: "host closed its join link with
rank(s) [0, 1] unreported" (seen once in CI, tests/hosts/test_join_over_ssh.py). The agent now half-closes
the link and waits for the controller to close its end, which it does only after reading everything.

Here a TCP forward of our own stands in for ssh: it carries every byte 0.3 s late (and passes each half-
close on), and it is cut, both directions at once, the moment the agent process exits.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from flodld.membership.phase import Phase

from .workers import fault_options, fault_run

pytestmark = pytest.mark.multiproc

LATENCY_SECS = 0.3
RUN_BOUND_SECS = 90.0


class LateForward:
    """127.0.0.1:port -> the controller's port; every chunk delivered LATENCY_SECS late, EOF passed on."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.writers: list[asyncio.StreamWriter] = []
        self.pumps: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(source, sink))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            while chunk := await source.read(65536):
                await asyncio.sleep(LATENCY_SECS)
                sink.write(chunk)
                await sink.drain()
            await asyncio.sleep(LATENCY_SECS)
            sink.write_eof()

    def cut(self) -> None:
        """What SIGTERM to an ssh client does to its forwards: every connection gone, nothing flushed."""
        assert self.server is not None
        self.server.close()
        for task in list(self.pumps):
            task.cancel()
        for writer in self.writers:
            writer.transport.abort()


async def test_the_agents_last_reports_outlive_a_forward_cut_when_it_exits() -> None:
    async with fault_run(fault_options()) as run:
        forward = LateForward(run.port)
        run.port = await forward.start()  # the agent dials the forward; its relay and ranks follow it
        agent = await run.spawn_agent("far", ranks=2, FAULT_STEPS="3")
        try:
            code = await asyncio.wait_for(agent.process.wait(), RUN_BOUND_SECS)
        finally:
            forward.cut()
        result = await asyncio.wait_for(run.controller.wait(), RUN_BOUND_SECS)
        assert code == 0, agent.output[-3000:]
        assert result.verdict is Phase.DONE, (result, agent.output[-3000:])
        assert "unreported" not in result.reason, result.reason
