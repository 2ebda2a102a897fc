"""Issue 18: state.json is built at most once per change and per interval, encoded once for every reader,
paged on request, and summarized by default; a storm of log lines is coalesced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import pytest

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.service import Service
from flodld.controller.status.snapshot import (
    ALL_MEMBERS,
    DEFAULT_MEMBERS,
    STATE_INTERVAL_SECS,
    STATE_MAX_AGE_SECS,
    BadMembersQuery,
    StateCache,
    StormLog,
    parse_members,
)
from flodld.membership.snapshot import StateSnapshot
from tests.flodld.controller.agents import http, join, options, started


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _build(builds: list[object], members: object) -> dict[str, int]:
    builds.append(members)
    return {"n": len(builds)}


def test_many_readers_share_one_build_and_one_encoding() -> None:
    clock, version = Clock(), [0]
    builds: list[object] = []
    cache = StateCache(lambda members: _build(builds, members), lambda: version[0], clock=clock)
    bodies = [cache.get().body for _ in range(100)]
    assert (
        builds == [DEFAULT_MEMBERS] and all(body is bodies[0] for body in bodies) and bodies[0] == b'{"n":1}'
    )
    version[0] += 1  # a change within the interval waits for it
    clock.now += STATE_INTERVAL_SECS / 2
    assert cache.get().data == {"n": 1}
    clock.now += STATE_INTERVAL_SECS
    assert cache.get().data == {"n": 2}
    clock.now += STATE_INTERVAL_SECS * 2  # no change: kept until max_age (countdowns, connection counts)
    assert cache.get().data == {"n": 2}
    clock.now += STATE_MAX_AGE_SECS
    assert cache.get().data == {"n": 3}
    cache.clear()  # a phase change: at once
    assert cache.get().data == {"n": 4}
    assert cache.get((0, 10)).data == {"n": 5} and cache.get().data == {"n": 4}  # pages side by side


def test_an_expensive_build_is_held_ten_times_as_long_as_it_cost() -> None:
    clock, version, builds = Clock(), [0], []

    def build(members: tuple[int, int]) -> dict[str, int]:
        time.sleep(0.05)  # a ?members=all of a large world
        builds.append(members)
        return {"n": len(builds)}

    cache = StateCache(build, lambda: version[0], clock=clock)
    assert cache.get(ALL_MEMBERS).data == {"n": 1}
    version[0] += 1
    clock.now += 0.4  # past the 200 ms interval, within 10 x the build's cost (>= 0.5 s)
    assert cache.get(ALL_MEMBERS).data == {"n": 1}
    clock.now += 10.0  # long past it (the sleep would have to take a second to hold it this long)
    assert cache.get(ALL_MEMBERS).data == {"n": 2}


def test_members_query_parsing() -> None:
    assert parse_members(None) == DEFAULT_MEMBERS and parse_members("all") == ALL_MEMBERS
    assert parse_members("0..499") == (0, 500) and parse_members("7..7") == (7, 8)
    for bad in ("1..0", "-1..3", "a..b", "3", "0..99999999999", "0...3"):
        with pytest.raises(BadMembersQuery):
            parse_members(bad)


def test_a_storm_of_lines_is_coalesced_into_a_count() -> None:
    clock = Clock()
    logger = logging.getLogger("test.storm")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        storm = StormLog(logger, burst=5, period=1.0, clock=clock)
        for i in range(1000):
            detail = functools.partial(str.format, "host=h{}", i)
            storm.event("joined", logging.INFO, "event=joined host=%s", f"h{i}", detail=detail)
        assert len(records) == 5
        clock.now += 1.0
        storm.tick()
        assert records[-1] == "event=joined_coalesced count=995 period_secs=1 last: host=h999"
        storm.event("joined", logging.INFO, "event=joined host=%s", "again")
        assert records[-1] == "event=joined host=again"  # a new period starts with lines again
    finally:
        logger.removeHandler(handler)


async def test_state_json_pages_validate_against_the_schema_and_bad_pages_are_refused() -> None:
    controller, port = await started(options(capacity=5, join=JoinConfig(join_timeout=30)))
    try:
        agents = [await join(port, controller.salt, host) for host in ("a", "b", "c")]  # links stay open
        assert all(a.accepted for a in agents)
        await asyncio.sleep(STATE_INTERVAL_SECS)
        status, body = await http(port, "GET", "/state.json")
        assert status == 200 and [m["host"] for m in body["members"]] == ["a", "b", "c"]
        assert body["members_page"] == {"start": 0, "stop": 3, "total": 3}
        StateSnapshot.model_validate(body)
        status, page = await http(port, "GET", "/state.json?members=1..1")
        assert status == 200 and [m["host"] for m in page["members"]] == ["b"]
        StateSnapshot.model_validate(page)
        status, refused = await http(port, "GET", "/state.json?members=9..2")
        assert status == 400 and refused["code"] == "bad_members"
    finally:
        await controller.close()


async def test_pollers_during_a_join_storm_cost_one_build_per_interval() -> None:
    controller, port = await started(
        options(capacity=300, join=JoinConfig(join_timeout=60), handshake_timeout=30.0, magic_deadline=30.0)
    )
    stop = asyncio.Event()
    polls = 0

    async def poll() -> None:
        nonlocal polls
        while not stop.is_set():
            status, _ = await http(port, "GET", "/state.json")
            assert status == 200
            polls += 1

    try:
        loop = asyncio.get_running_loop()
        pollers = [asyncio.create_task(poll()) for _ in range(8)]
        begun = loop.time()
        agents = await asyncio.gather(*(join(port, controller.salt, f"h{i:03d}") for i in range(300)))
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*pollers)
        elapsed = loop.time() - begun
        assert all(a.accepted for a in agents)
        # one build per interval, plus one per phase change (waiting -> forming -> training)
        assert controller.state_cache.builds <= elapsed / STATE_INTERVAL_SECS + 6, (
            controller.state_cache.builds,
            polls,
        )
        assert polls > controller.state_cache.builds
    finally:
        await controller.close()


async def test_the_service_state_shares_the_runs_build_and_summarizes_history_hosts() -> None:
    service = Service(
        ControllerOptions.model_validate(
            {
                "bind_host": "127.0.0.1",
                "port": 0,
                "tick_interval": 0.02,
                "run_id": "svc",
                "capacity": 2,
                "between_runs_secs": 30,
            }
        )
    )
    task = asyncio.create_task(service.serve())
    try:
        for _ in range(200):
            if service.controller is not None and service.controller.window is not None:
                break
            await asyncio.sleep(0.01)
        assert service.address is not None and service.controller is not None
        port = service.address[1]
        _, body = await http(port, "GET", "/state.json")
        assert body["service"]["runs_started"] == 1 and body["history"] == []
        StateSnapshot.model_validate(body)
        service.controller.abort("test over")  # a run ending shows at once, whatever the interval
        for _ in range(200):
            if service.history:
                break
            await asyncio.sleep(0.01)
        _, body = await http(port, "GET", "/state.json")
        assert body["history"][0]["verdict"] == "failed" and body["history"][0]["host_count"] == 0
        assert body["service"]["between_runs"] is True
        StateSnapshot.model_validate(body)
    finally:
        service.stop("test over")
        await asyncio.wait_for(task, 10)


def test_fdl_status_prints_the_counts_and_the_first_hosts_of_a_large_world() -> None:
    from fdl.status import LISTED_HOSTS, render, render_history

    members = [
        {
            "host": f"h{i:04d}",
            "ranks": [i],
            "devices": ["cpu:0"],
            "device_labels": [],
            "variant": "cpu",
            "joined_at_secs": 1.0,
            "link": "open",
        }
        for i in range(500)
    ]
    state = {
        "phase": "training",
        "joined_ranks": 5000,
        "joined_hosts": 5000,
        "members": members,
        "members_page": {"start": 0, "stop": 500, "total": 5000},
        "member_counts": {"by_link": {"open": 5000}, "by_variant": {"cpu": 5000}, "by_vendor": {"cpu": 5000}},
        "history": [
            {
                "run_id": "r",
                "verdict": "done",
                "ranks": 5000,
                "hosts": ["h0000", "h0001"],
                "host_count": 5000,
                "rank_exits": [],
            }
        ],
    }
    text = render(state, "127.0.0.1:1337")
    assert "hosts: 5000 (links open 5000; variants cpu 5000; devices cpu 5000)" in text
    assert f"hosts 0..{LISTED_HOSTS - 1} of 5000 (more: fdl status --members A..B)" in text
    assert "h0049" in text and "h0050" not in text
    assert "h0499" in render(state, "127.0.0.1:1337", list_all=True)
    assert "h0000, h0001 +4998 more" in render_history(state)  # the record lists 2 of its 5000 hosts
