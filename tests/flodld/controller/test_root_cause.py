"""The run's root cause over real loopback join links: the culprit's report arriving after a victim's."""

from __future__ import annotations

import asyncio

from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from flodld.wire.join import RankExited
from tests.reliability.daemon import running

from .agents import http, join, options


async def test_a_culprit_reported_after_its_victims_is_the_root_cause_in_state_and_history() -> None:
    async with running(options(capacity=4, join=JoinConfig(join_timeout=30))) as (controller, port):
        a = await join(port, controller.salt, "a", devices=2)  # ranks 0, 1: rank 1 is the culprit
        b = await join(port, controller.salt, "b", devices=2)  # ranks 2, 3: its victims
        await a.world()
        await b.world()
        # Host b's rank 2 lost its collective partner and failed on its own 20 ms after rank 1 died; its
        # report reaches the controller first and decides the verdict.
        await b.stream.send(RankExited(rank=2, code=1, failed_at=1000.020, error="RuntimeError: peer gone"))
        await b.abort()
        await b.stream.send(RankExited(rank=3, code=-15, failed_at=1000.300, torn_down=True))
        await b.stream.aclose()
        # Host a: rank 0 was torn down by its agent (earliest timestamp of all, but a consequence), rank 1 is
        # the culprit with its exception and traceback.
        await a.abort()
        await a.stream.send(RankExited(rank=0, code=-15, failed_at=999.0, torn_down=True))
        tail = "Traceback (most recent call last):\nRuntimeError: rank 1 fails on purpose"
        await a.stream.send(
            RankExited(
                rank=1, code=1, failed_at=1000.0, error="RuntimeError: rank 1 fails on purpose", tail=tail
            )
        )
        await a.stream.aclose()
        result = await asyncio.wait_for(controller.wait(), 5)
        assert result.verdict is Phase.FAILED and "ranks [2]" in result.reason  # the verdict: first report
        cause = result.root_cause
        assert cause is not None
        assert (cause.host, cause.rank, cause.code, cause.error) == (
            "a",
            1,
            1,
            "RuntimeError: rank 1 fails on purpose",
        )
        assert cause.tail == tail.splitlines() and (cause.failed_ranks, cause.consequences) == (4, 2)
        status, state = await http(port, "GET", "/state.json")
        assert status == 200 and state["root_cause"]["rank"] == 1 and state["root_cause"]["host"] == "a"
        assert controller.run_record().root_cause == cause


async def test_a_run_that_fails_without_a_rank_failing_on_its_own_has_no_root_cause() -> None:
    async with running(options(capacity=1)) as (controller, port):
        a = await join(port, controller.salt, "a")
        await a.world()
        stopping = asyncio.ensure_future(controller.stop("operator pressed ctrl-c"))
        await a.abort()
        await a.stream.send(RankExited(rank=0, code=-15, failed_at=5.0, torn_down=True))
        await a.stream.aclose()
        result = await asyncio.wait_for(stopping, 5)
        assert result.verdict is Phase.FAILED and result.root_cause is None
