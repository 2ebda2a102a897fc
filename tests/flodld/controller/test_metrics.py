"""/metrics: the Prometheus exposition parses strictly, and its per-run and per-rank series are right.

Unit tests feed the real sans-io tally (`RunMetrics`) and the real counters with explicit times and
render them; the socket tests form a real two-host cpu_sync world on loopback, play the two relays
over the DATA and CONTROL channels, and read /metrics over HTTP.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from flodld.controller.status.metrics import (
    RANK_SERIES_CAP,
    ControllerCounters,
    RunMetrics,
    RunSeries,
    render_prometheus,
)
from flodld.fold.codec import encode_bundle
from flodld.net.stream import FramedStream
from flodld.wire.control import Heartbeat
from flodld.wire.data import Broadcast, HelloAck, HostFrame
from flodld.wire.magic import Channel

from .agents import eventually
from .prometheus import parse_strict
from .relays import open_relay, two_hosts


def _series(data: RunMetrics, run_id: str = "run-1", **overrides: int) -> RunSeries:
    values = {"restarts": 0, "max_restarts": 0, "admitted_hosts": 0, "admitted_ranks": 0, "lost_ranks": 0}
    values.update(overrides)
    return RunSeries(run_id=run_id, data=data, **values)


def _render(data: RunMetrics, run_id: str = "run-1", **overrides: int) -> str:
    counters = ControllerCounters()
    counters.refusals["bad_tag"] += 2
    counters.frame_in("join", 1_234_567_891)  # past 1e6: printed exactly, not as 1.23457e+09
    return render_prometheus(
        counters,
        phase="training",
        joined_ranks=2,
        joined_hosts=2,
        run_id=run_id,
        runs={"done": 1, "failed": 0},
        run=_series(data, run_id, **overrides),
    )


def test_round_times_deposit_delays_and_bytes_follow_the_clock_it_is_given() -> None:
    data = RunMetrics()
    # Round 0: host a (ranks 0, 1) at t=10, host b (rank 2) at t=10.25 in two chunks; done at t=10.5.
    data.host_chunk(0, 0, [0, 1], 64, now=10.0)
    data.host_chunk(0, 0, [2], 32, now=10.25)
    data.host_chunk(0, 32, [2], 32, now=10.3)  # a later chunk is no new deposit
    data.round_finished(0, now=10.5)
    for _ in range(2):
        data.sent(64)
    # Round 1: host b first this time; the round takes 3 s.
    data.host_chunk(1, 0, [2], 64, now=20.0)
    data.host_chunk(1, 0, [0, 1], 64, now=21.0)
    data.round_finished(1, now=23.0)
    data.heartbeat(0, 2)
    data.heartbeat(0, 1)  # an older heartbeat overtaken on the wire never lowers the count
    data.heartbeat(2, 2)
    data.rank_dead()

    families = parse_strict(_render(data, restarts=1, max_restarts=3, admitted_hosts=2, admitted_ranks=3))
    who = {"run_id": "run-1"}
    assert families["flodld_rounds_total"].value(**who) == 2
    duration = families["flodld_round_duration_seconds"]
    assert duration.value("flodld_round_duration_seconds_count", **who) == 2
    assert duration.value("flodld_round_duration_seconds_sum", **who) == pytest.approx(3.5)
    assert duration.value("flodld_round_duration_seconds_bucket", le="0.25", **who) == 0
    assert duration.value("flodld_round_duration_seconds_bucket", le="0.5", **who) == 1
    assert duration.value("flodld_round_duration_seconds_bucket", le="2.5", **who) == 1
    assert duration.value("flodld_round_duration_seconds_bucket", le="5", **who) == 2
    assert duration.value("flodld_round_duration_seconds_bucket", le="+Inf", **who) == 2
    delay = families["flodld_rank_deposit_delay_seconds"]
    assert delay.value("flodld_rank_deposit_delay_seconds_sum", rank="0", **who) == pytest.approx(1.0)
    assert delay.value("flodld_rank_deposit_delay_seconds_sum", rank="2", **who) == pytest.approx(0.25)
    assert delay.value("flodld_rank_deposit_delay_seconds_count", rank="1", **who) == 2
    last = families["flodld_rank_last_deposit_delay_seconds"]
    assert (last.value(rank="1", **who), last.value(rank="2", **who)) == (1.0, 0.0)
    rounds = families["flodld_rank_rounds_total"]
    assert rounds.labelled("flodld_rank_rounds_total") == {
        (("rank", "0"), ("run_id", "run-1")): 2,
        (("rank", "1"), ("run_id", "run-1")): 0,  # deposited, not yet heard from
        (("rank", "2"), ("run_id", "run-1")): 2,
    }
    assert families["flodld_dataplane_received_bytes_total"].value(**who) == 64 + 32 + 32 + 64 + 64
    assert families["flodld_dataplane_sent_bytes_total"].value(**who) == 128
    assert families["flodld_ranks_declared_dead_total"].value(**who) == 1
    assert families["flodld_run_restarts"].value(**who) == 1
    assert families["flodld_run_max_restarts"].value(**who) == 3
    assert families["flodld_join_admissions_total"].value(**who) == 2
    assert families["flodld_join_admitted_ranks_total"].value(**who) == 3
    assert families["flodld_received_bytes_total"].value(channel="join") == 1_234_567_891
    assert families["flodld_join_refusals_total"].value(reason="bad_tag") == 2


def test_per_rank_series_stop_at_the_cap_and_the_run_wide_ones_count_every_rank() -> None:
    data = RunMetrics()
    ranks = list(range(RANK_SERIES_CAP + 500))
    data.host_chunk(0, 0, ranks, 8, now=0.0)
    data.round_finished(0, now=1.0)
    for rank in ranks:
        data.heartbeat(rank, 1)
    families = parse_strict(_render(data))
    rounds = families["flodld_rank_rounds_total"].labelled()
    assert len(rounds) == RANK_SERIES_CAP
    assert {dict(labels)["rank"] for labels in rounds} == {str(rank) for rank in range(RANK_SERIES_CAP)}
    assert len(families["flodld_rank_last_deposit_delay_seconds"].labelled()) == RANK_SERIES_CAP
    assert families["flodld_rounds_total"].value(run_id="run-1") == 1


def test_a_run_id_with_quotes_backslashes_and_newlines_is_escaped_and_parses_back() -> None:
    hostile = 'a"b\\c\nd} 1\n# TYPE x counter'
    families = parse_strict(_render(RunMetrics(), run_id=hostile))
    assert families["flodld_run_info"].value(run_id=hostile) == 1
    assert families["flodld_rounds_total"].value(run_id=hostile) == 0


def test_an_empty_run_parses_strictly_with_every_documented_family() -> None:
    families = parse_strict(_render(RunMetrics()))
    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    documented: dict[str, str] = {}  # name -> the Type column of its row in the Metrics table
    for row in re.findall(r"^\| (`flodld_[^|]*) \| (\w+) \|", doc, re.MULTILINE):
        for name in re.findall(r"`(flodld_\w+)`", row[0]):
            documented[name] = row[1]
    for name, family in families.items():
        assert documented.get(name) == family.kind, f"{name} ({family.kind}) is not in docs/operations.md"
    # The delays summary has no samples until a deposit reached the controller; it still has HELP/TYPE.
    assert families["flodld_rank_deposit_delay_seconds"].samples == {}


def test_no_secret_reaches_the_metrics() -> None:
    data = RunMetrics()
    text = _render(data)
    assert "salt" not in text.lower() and "token" not in text.lower()


async def _host_frame(stream: FramedStream, round_number: int, rank: int, value: float) -> int:
    """One host's whole partial fold of `round_number` (4 float32: 16 tensor bytes); returns its bytes."""
    specs, tail = encode_bundle([torch.full((4,), value)])
    await stream.send(
        HostFrame(round=round_number, fold="mean", weight=1.0, contributors=[rank], tensors=specs), tail
    )
    return len(tail)


async def _http_metrics(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/plain" in head
    return body.decode()


async def test_a_two_host_world_shows_rounds_bytes_heartbeats_admissions_and_a_lost_rank() -> None:
    async with two_hosts() as world:
        controller, port = world.controller, world.port
        data: dict[str, FramedStream] = {}
        control: dict[str, FramedStream] = {}
        for host, rank in (("a", 0), ("b", 1)):
            data[host], ack = await open_relay(
                port, controller.salt, world.keys[host], Channel.DATA, host=host, ranks=[rank]
            )
            assert isinstance(ack, HelloAck) and not ack.sole_host
            control[host], ack = await open_relay(
                port, controller.salt, world.keys[host], Channel.CONTROL, host=host, ranks=[rank]
            )
            assert isinstance(ack, HelloAck)
        sent = 0
        for round_number in range(2):
            for host, rank in (("a", 0), ("b", 1)):
                sent += await _host_frame(data[host], round_number, rank, float(rank))
            for host in ("a", "b"):
                message = (await data[host].recv(5)).message()
                assert isinstance(message, Broadcast) and message.round == round_number
        for step in (1, 2):  # the second heartbeat of each rank ends a gap
            for host, rank in (("a", 0), ("b", 1)):
                await control[host].send(Heartbeat(rank=rank, step=step))
        await eventually(
            lambda: (
                controller.run_metrics.ranks.get(1, None) is not None
                and controller.run_metrics.ranks[1].rounds == 2
            )
        )
        state = controller.state_json()
        assert state is not None
        heartbeats = state["heartbeats"]
        assert heartbeats["longest_gap_rank"] in (0, 1)
        assert heartbeats["timeout_secs"] == controller.run_metrics.liveness_timeout
        assert heartbeats["timeout_secs"] > 0
        assert 0 <= heartbeats["longest_gap_secs"] < heartbeats["timeout_secs"]
        await world.agents["b"].report_exit(1, 3)
        await eventually(lambda: controller.window is not None and controller.window.failed_ranks() == [1])

        families = parse_strict(await _http_metrics(port))
        who = {"run_id": controller.run_id}
        assert families["flodld_rounds_total"].value(**who) == 2
        assert families["flodld_heartbeat_longest_gap_seconds"].value(**who) == pytest.approx(
            heartbeats["longest_gap_secs"], abs=1e-3
        )
        assert (
            families["flodld_round_duration_seconds"].value("flodld_round_duration_seconds_count", **who) == 2
        )
        assert sent == 4 * 16
        assert families["flodld_dataplane_received_bytes_total"].value(**who) == sent
        # Each round's 16-byte mean went to both relays.
        assert families["flodld_dataplane_sent_bytes_total"].value(**who) == 2 * 2 * 16
        delays = families["flodld_rank_deposit_delay_seconds"]
        for label in ("0", "1"):
            assert families["flodld_rank_rounds_total"].value(rank=label, **who) == 2
            assert delays.value("flodld_rank_deposit_delay_seconds_count", rank=label, **who) == 2
        assert families["flodld_join_admissions_total"].value(**who) == 2
        assert families["flodld_join_admitted_ranks_total"].value(**who) == 2
        assert families["flodld_lost_ranks"].value(**who) == 1
        assert families["flodld_run_restarts"].value(**who) == 0
        assert families["flodld_phase"].value(phase="failed") == 1
        assert controller.salt_hex not in str(families)


def test_the_slowest_ranks_are_those_whose_deposits_reach_the_fold_latest_on_average() -> None:
    metrics = RunMetrics()
    assert metrics.slowest(5) == []
    for number, late in enumerate((0.5, 1.5)):
        metrics.host_chunk(number, 0, [0, 1], 8, 100.0 + number)  # host a opens the round
        metrics.host_chunk(number, 0, [2], 8, 100.0 + number + late)  # host b's rank 2, late
    assert metrics.slowest(2) == [
        {"rank": 2, "mean_delay_secs": 1.0, "last_delay_secs": 1.5, "rounds": 2, "skipped": 0},
        {"rank": 0, "mean_delay_secs": 0.0, "last_delay_secs": 0.0, "rounds": 2, "skipped": 0},
    ]
    # A rank rounds closed without (straggler_timeout) comes first, whatever its delays.
    metrics.skipped(1)
    metrics.skipped(3)
    assert [(row["rank"], row["skipped"]) for row in metrics.slowest(3)] == [(1, 1), (3, 1), (2, 0)]


def test_heartbeats_keep_the_longest_gap_a_live_rank_left_against_the_limits() -> None:
    data = RunMetrics()
    data.heartbeat(0, 1, gap=None)
    assert data.heartbeats() is None  # the plane has not set its limits
    data.liveness_timeout, data.heartbeat_interval = 1.5, 0.25
    assert data.heartbeats() is None  # no rank heard twice yet
    assert data.heartbeat(0, 2, gap=0.26) is True  # the run's longest gap yet
    assert data.heartbeat(3, 2, gap=0.71) is True
    assert data.heartbeat(0, 3, gap=0.3) is False
    assert data.heartbeats() == {
        "timeout_secs": 1.5,
        "interval_secs": 0.25,
        "longest_gap_secs": 0.71,
        "longest_gap_rank": 3,
    }
    assert "flodld_heartbeat_longest_gap_seconds{run_id=\"run-1\"} 0.71" in _render(data)


async def test_a_live_ranks_heartbeat_gap_near_the_timeout_is_logged_once_per_new_longest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {"FLODL_LIVENESS_TIMEOUT_SECS": "4", "FLODL_HEARTBEAT_INTERVAL_SECS": "1"}
    async with two_hosts(environ) as world:
        controller, port = world.controller, world.port
        control, ack = await open_relay(
            port, controller.salt, world.keys["a"], Channel.CONTROL, host="a", ranks=[0]
        )
        assert isinstance(ack, HelloAck)
        caplog.set_level("WARNING", logger="flodld.controller.dataplane")
        await control.send(Heartbeat(rank=0, step=1))
        await control.send(Heartbeat(rank=0, step=2))  # a short gap: nothing said
        await asyncio.sleep(2.4)  # past half the 4 s timeout, short of it (with room for a loaded box)
        await control.send(Heartbeat(rank=0, step=3))
        await control.send(Heartbeat(rank=0, step=4))
        await eventually(lambda: controller.run_metrics.ranks[0].rounds == 4)
    warnings = [r.getMessage() for r in caplog.records if "heartbeat_gap_near_timeout" in r.getMessage()]
    assert len(warnings) == 1, warnings
    said = re.search(r"host=a rank=0 gap_secs=([0-9.]+) timeout_secs=4 ", warnings[0])
    assert said is not None, warnings[0]
    assert 2.0 < float(said.group(1)) < 4.0
