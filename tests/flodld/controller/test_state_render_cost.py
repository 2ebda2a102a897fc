"""Issue 29 (3): what an unauthenticated reader can make the controller spend is bounded.

A page of members is cut from one build per state version: the build's fields are encoded once, each member
row once, and any `?members=A..B` is a splice of those bytes, byte for byte what encoding the page's own dict
gives. The status page is rendered once per build. Work past the cache is charged to a render budget (per
source address and in all); past it a reader gets 429 with Retry-After, naming the budget, while answers
already in the cache stay free. Counted, never timed.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from flodld.controller.status.snapshot import (
    ALL_MEMBERS,
    DEFAULT_MEMBERS,
    MemberRange,
    RenderBudget,
    RenderRefused,
)
from flodld.controller.status.summary import summarised
from flodld.membership.window import JoinWindow
from tests.flodld.controller.agents import options, started
from tests.flodld.membership.helpers import hello, policy

HOSTS = 120
NOW = 7.25


def _controller(hosts: int = HOSTS, *, room: int = 16) -> Controller:
    """A controller (not listening) with a window of `hosts` members of two ranks carrying long device
    labels, and `room` ranks to spare (0: the window has its target and forms).
    """
    controller = Controller(options(capacity=2 * hosts + room), clock=lambda: NOW)
    window = JoinWindow(policy(capacity=2 * hosts + room), [], 0.0, run_id="r", controller="127.0.0.1:1")
    for i in range(hosts):
        labels = [f"NVIDIA H200 \u00e9 \"{i}\" " + "x" * (i % 50) for _ in range(2)]
        window.hello(hello(f"host-{i:04d}", 2, device_labels=labels), 0.5 + i / 1000)
    controller.window = window
    controller.state_cache.interval = 3600.0  # one build for the test's length, whatever the machine
    return controller


def _reference(controller: Controller, members: MemberRange) -> bytes:
    """The page as the code before issue 29 encoded it: the window's dict for the page, in one json.dumps."""
    window = controller.window
    assert window is not None
    state: dict[str, Any] = window.state(NOW, members)
    connections = {
        "by_channel": dict(sorted(controller.counters.connections.items())),
        "dropped": dict(sorted(controller.counters.dropped.items())),
    }
    state["connections"] = connections
    for reason, count in connections["dropped"].items():
        state["refused"][f"connection_{reason}"] = count
    return json.dumps(summarised(state), separators=(",", ":")).encode()  # its headline's words last


RANGES: list[MemberRange] = [
    DEFAULT_MEMBERS, ALL_MEMBERS, (0, 1), (17, 18), (5, 64), (HOSTS - 1, HOSTS), (HOSTS - 3, 900),
    (HOSTS, 500), (400, 401), (0, HOSTS),
]  # fmt: skip


def test_every_page_is_byte_identical_to_encoding_its_own_dict() -> None:
    controller = _controller(room=0)
    for members in RANGES:
        assert controller.state_body(members) == _reference(controller, members), members
    window = controller.window
    assert window is not None
    window.form(NOW)  # ranks from the formed world, and a link state that differs
    window.host_closed("host-0003", NOW, lost=True, why="test")
    controller.state_cache.clear()
    for members in RANGES:
        assert controller.state_body(members) == _reference(controller, members), members


def test_distinct_member_ranges_cost_one_build_one_encoding_and_each_row_once() -> None:
    controller = _controller()
    rng = random.Random(29)
    for _ in range(300):
        start = rng.randrange(HOSTS)
        members = (start, rng.randrange(start, HOSTS) + 1)
        assert controller.state_body(members) == _reference(controller, members)
    assert controller.state_body(ALL_MEMBERS) == _reference(controller, ALL_MEMBERS)
    assert controller.state_cache.builds == 1
    assert controller.state_cache.get().encodes == 1
    assert controller.status.row_encodes == HOSTS
    # A new version: one more build and encoding; only the new member's row is encoded again.
    window = controller.window
    assert window is not None
    window.hello(hello("late", 1), 3.0)
    controller.state_cache.clear()
    assert controller.state_body(ALL_MEMBERS) == _reference(controller, ALL_MEMBERS)
    assert controller.state_cache.builds == 2 and controller.state_cache.get().encodes == 1
    assert controller.status.row_encodes == HOSTS + 1


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_render_budget_refuses_past_its_rate_per_source_and_in_all_and_names_it() -> None:
    clock = Clock()
    budget = RenderBudget(rate=1.0, burst=1.0, source_rate=0.5, source_burst=0.5, clock=clock)
    budget.admit("a")
    budget.spend("a", 0.6)  # over its own bucket
    with pytest.raises(RenderRefused) as refused:
        budget.admit("a")
    assert "this address spent its render budget (0.5 s of controller time per second)" in str(refused.value)
    assert refused.value.retry_after == 1
    budget.admit("b")  # another address still has its share, and the global bucket is not spent
    budget.spend("b", 0.5)
    with pytest.raises(RenderRefused) as refused:
        budget.admit("c")  # the global bucket is spent (1.1 s of 1.0)
    assert "render budget for unauthenticated readers (1 s per second) is spent" in str(refused.value)
    assert budget.refused == 2
    clock.now += 1.0  # both buckets refill at their rates
    budget.admit("a")
    budget.admit("c")
    with pytest.raises(ValueError, match="rates and bursts are > 0"):
        RenderBudget(rate=0)


def test_a_reader_past_the_budget_is_refused_and_cached_answers_stay_free() -> None:
    controller = _controller()
    clock = Clock()
    controller.state_cache.budget = budget = RenderBudget(
        rate=1.0, burst=1.0, source_rate=1e-6, source_burst=1e-6, clock=clock
    )
    assert controller.state_body((0, 5), "198.51.100.1") is not None  # the first miss fits the burst
    with pytest.raises(RenderRefused) as refused:
        controller.state_body((5, 10), "198.51.100.1")  # the next one does not
    assert refused.value.retry_after >= 1
    for _ in range(50):  # the page already made is free, however often it is asked for
        assert controller.state_body((0, 5), "198.51.100.1") == _reference(controller, (0, 5))
    assert controller.state_body((5, 10), "198.51.100.2") is not None  # another address has its own share
    assert budget.refused == 1
    assert controller.counters.dropped["http_busy"] == 0  # counted by the controller's own budget only


async def _get(port: int, target: str) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status.split(" ", 2)[1]), fields, body


@pytest.mark.parametrize("target", ["/state.json?members=%d..%d", "/state.json?members=%d..%d&x=aiohttp"])
async def test_over_http_a_flood_of_distinct_ranges_gets_429_with_retry_after(target: str) -> None:
    controller, port = await started(options(capacity=4, join=JoinConfig(join_timeout=30)))
    try:
        controller.state_cache.interval = 3600.0
        controller.render_budget = controller.state_cache.budget = RenderBudget(
            rate=1.0, burst=1.0, source_rate=1e-6, source_burst=1e-6, on_refused=controller.status.count_busy
        )
        answers = [await _get(port, target % (i, i + 1)) for i in range(6)]
        assert answers[0][0] == 200
        busy = [(fields, body) for status, fields, body in answers if status == 429]
        assert len(busy) == 5, [a[0] for a in answers]
        fields, body = busy[0]
        assert int(fields["retry-after"]) >= 1
        refusal = json.loads(body)
        assert refusal["code"] == "render_budget" and "render budget" in refusal["error"]
        assert (await _get(port, target % (0, 1)))[0] == 200  # the cached page: free
        assert controller.counters.dropped["http_busy"] == 5
    finally:
        await controller.close()


async def test_the_status_page_is_rendered_once_per_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import flodld.controller.runstatus as runstatus
    import flodld.controller.status.page as page

    renders = 0
    original = page.render_page

    def counted(state: Any) -> str:  # noqa: ANN401  the page's state mapping
        nonlocal renders
        renders += 1
        return original(state)

    monkeypatch.setattr(page, "render_page", counted)
    monkeypatch.setattr(runstatus, "render_page", counted)
    controller, port = await started(options(capacity=4, join=JoinConfig(join_timeout=30)))
    try:
        controller.state_cache.interval = controller.state_cache.max_age = 3600.0
        pages = [await _get(port, "/status") for _ in range(30)]
        assert all(status == 200 for status, _, _ in pages)
        assert len({body for _, _, body in pages}) == 1
        assert b"<!doctype html>" in pages[0][2]
        assert renders == 1
    finally:
        await controller.close()
