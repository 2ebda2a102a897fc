"""`flodld serve` as a service, in process: one port, run after run, history, stop and reload."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.service import Service
from flodld.wire.join import Abort, Accept
from flodld.wire.salt import OPEN_ADMISSION_KEY, new_salt, salt_to_hex

from .agents import Agent, http, join, options


def two_rank_options(**overrides: object) -> ControllerOptions:
    values: dict[str, object] = {
        "capacity": 2, "averaging": "nccl_sync", "run_id": "svc",
        "join": JoinConfig(join_timeout=30, target_ranks=2, min_rank_start=2, token=salt_to_hex(new_salt())),
    }
    values.update(overrides)
    return options(**values)


async def until_window(service: Service, run_number: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (service.runs_started == run_number and service.controller is not None
               and service.controller.result is None and service.controller.window is not None):
        assert loop.time() < deadline, f"run {run_number} never opened its window"
        await asyncio.sleep(0.01)


async def join_two(service: Service, port: int, key: bytes | None = None, *, open_admission: bool = False
                   ) -> tuple[Agent, Agent]:
    assert service.controller is not None
    salt = key if key is not None else service.controller.join_key
    a = await join(port, salt, "a", open_admission=open_admission)
    b = await join(port, salt, "b", open_admission=open_admission)
    await a.world()
    await b.world()
    return a, b


async def test_three_runs_on_one_port_each_with_its_verdict_in_the_history() -> None:
    service = Service(two_rank_options())
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    polled: list[int] = []

    async def poll() -> None:  # state.json answers at every moment, between runs included
        while True:
            status, _ = await http(port, "GET", "/state.json")
            polled.append(status)
            await asyncio.sleep(0.01)

    poller = asyncio.ensure_future(poll())
    try:
        run_ids = []
        for number, failing in ((1, False), (2, True), (3, False)):
            await until_window(service, number)
            assert service.controller is not None
            run_ids.append(service.controller.run_id)
            a, b = await join_two(service, port)
            if failing:
                await a.report_exit(a.world_ranks[0], 3)
                abort = await b.abort()
                assert "ranks failed (ranks [0])" in abort.reason, abort.reason
                await a.stream.aclose()
            else:
                await a.leave()
                await b.leave()
        await until_window(service, 4)
        status, state = await http(port, "GET", "/state.json")
        assert status == 200
        history = state["history"]
        assert [h["verdict"] for h in history] == ["done", "failed", "done"]
        assert [h["run_id"] for h in history] == list(reversed(run_ids))
        assert run_ids == ["svc-1", "svc-2", "svc-3"]
        assert state["run_id"] == "svc-4" and state["phase"] == "waiting"
        failed = history[1]
        assert failed["ranks"] == 2 and failed["hosts"] == ["a", "b"]
        assert {"rank": 0, "code": 3} in failed["rank_exits"]
        assert (
            failed["formed_at"] is not None
            and failed["started_at"] <= failed["formed_at"] <= failed["ended_at"]
        )
        assert state["service"]["runs"] == {"done": 2, "failed": 1}
        assert state["service"]["runs_started"] == 4
        _, metrics = await http_text(port, "/metrics")
        assert 'flodld_runs_total{verdict="done"} 2' in metrics
        assert 'flodld_runs_total{verdict="failed"} 1' in metrics
        assert 'flodld_run_info{run_id="svc-4"} 1' in metrics
        assert 'flodld_phase{phase="waiting"} 1' in metrics
        assert polled and set(polled) == {200}, set(polled)
    finally:
        poller.cancel()
        service.stop("test over")
        await asyncio.wait_for(serving, 10)


async def test_each_run_gets_a_fresh_salt_without_a_configured_token() -> None:
    opts = options(
        capacity=2,
        averaging="nccl_sync",
        join=JoinConfig(join_timeout=30, target_ranks=2, min_rank_start=2, open_admission=True),
    )
    service = Service(opts)
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    try:
        salts = []
        for number in (1, 2):
            await until_window(service, number)
            a, b = await join_two(service, port, OPEN_ADMISSION_KEY, open_admission=True)
            assert isinstance(a.reply, Accept) and a.reply.salt_hex is not None
            salts.append(a.reply.salt_hex)
            await a.leave()
            await b.leave()
        assert salts[0] != salts[1]
    finally:
        service.stop("test over")
        await asyncio.wait_for(serving, 10)


async def test_stop_aborts_the_current_run_and_records_the_reason() -> None:
    service = Service(two_rank_options())
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    await until_window(service, 1)
    a, b = await join_two(service, port)
    service.stop("controller received SIGTERM; run aborted")
    for agent in (a, b):
        abort = await agent.abort()
        assert isinstance(abort, Abort) and "SIGTERM" in abort.reason
    result = await asyncio.wait_for(serving, 10)
    assert result is not None and result.verdict.value == "failed"
    assert [h.verdict.value for h in service.history] == ["failed"]
    assert "SIGTERM" in service.history[0].reason
    with socket.socket() as probe:  # the port is closed once the service ends
        assert probe.connect_ex(("127.0.0.1", port)) != 0


async def test_reload_applies_from_the_next_window_and_a_broken_config_keeps_the_old_one() -> None:
    first = two_rank_options()
    wider = first.model_copy(
        update={"capacity": 3, "join": first.join.model_copy(update={"target_ranks": 3})}
    )
    loads: list[object] = [ValueError("line 3: bad key"), wider]

    def load() -> ControllerOptions:
        outcome = loads.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, ControllerOptions)
        return outcome

    service = Service(first, load=load, config_path="/etc/flodld/fdl.yml")
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    try:
        await until_window(service, 1)
        assert service.reload() is False
        _, state = await http(port, "GET", "/state.json")
        assert "bad key" in state["service"]["config_error"]
        assert state["target"] == 2
        assert service.reload() is True
        _, state = await http(port, "GET", "/state.json")
        assert state["service"]["config_error"] is None
        assert state["target"] == 2  # the open window keeps the config it opened with
        a, b = await join_two(service, port)
        await a.leave()
        await b.leave()
        await until_window(service, 2)
        _, state = await http(port, "GET", "/state.json")
        assert state["target"] == 3
    finally:
        service.stop("test over")
        await asyncio.wait_for(serving, 10)


async def test_between_runs_pause_is_visible_and_history_is_bounded() -> None:
    service = Service(two_rank_options(between_runs_secs=0.6, history_runs=1))
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    try:
        for number in (1, 2):
            await until_window(service, number)
            a, b = await join_two(service, port)
            await a.leave()
            await b.leave()
            if number == 1:
                await asyncio.sleep(0.2)
                _, state = await http(port, "GET", "/state.json")
                assert state["service"]["between_runs"] is True and state["phase"] == "done"
                assert 0 < state["service"]["next_window_in_secs"] <= 0.6
                status, body = await http(port, "POST", "/start")
                assert status == 503 and body["code"] == "no_window"
        await until_window(service, 3)
        assert [h.run_id for h in service.history] == ["svc-2"]
    finally:
        service.stop("test over")
        await asyncio.wait_for(serving, 10)


async def http_text(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


def test_fdl_status_names_the_previous_run_while_the_next_window_waits() -> None:
    from fdl.status import render, render_history

    state = {
        "phase": "waiting",
        "run_id": "svc-2",
        "joined_ranks": 0,
        "joined_hosts": 0,
        "quorum": 2,
        "target": 2,
        "window_remaining_secs": 30.0,
        "cap_remaining_secs": None,
        "members": [],
        "reason": "",
        "history": [
            {
                "run_id": "svc-1",
                "verdict": "failed",
                "reason": "1 of 2 ranks failed (ranks [1])",
                "started_at": 100.0,
                "formed_at": 101.0,
                "ended_at": 105.5,
                "ranks": 2,
                "hosts": ["a", "b"],
                "rank_exits": [{"rank": 0, "code": 0}, {"rank": 1, "code": 3}],
            }
        ],
        "service": {"between_runs": False, "config_error": None},
    }
    text = render(state, "127.0.0.1:1337")
    assert "previous run: svc-1 failed at " in text and "1 of 2 ranks failed" in text
    table = render_history(state)
    assert table.splitlines()[0].split()[:2] == ["RUN", "VERDICT"]
    assert table.splitlines()[1].split("  ")[:1] == ["svc-1"]
    assert "rank 1: 3" in table and "  5.5s  " in table and "  +1.0s  " in table  # the status page's words
    assert "no run history" in render_history({"phase": "done"})


async def test_a_reload_error_in_state_json_never_carries_a_hex_secret() -> None:
    secret = "0123456789abcdef0123456789abcdeX"

    def load() -> ControllerOptions:
        raise ValueError(f"token {secret!r} is not hex")

    service = Service(two_rank_options(), load=load)
    assert service.reload() is False
    assert service.config_error is not None and "0123456789abcdef" not in service.config_error
    assert "<redacted>" in service.config_error
