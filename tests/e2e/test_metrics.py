"""/metrics after a real run: two hosts (one rank each) average through the controller for 3 rounds.

An in-process controller on loopback (cpu_sync, its data plane attached) forms a world of two agent
processes; their ranks run tests/e2e/programs/metrics_rounds.py (rank 1 deposits 0.5 s late every
round). After the verdict, /metrics is read over HTTP, parsed strictly with prometheus_client's parser
and checked against what the run did.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from tests.e2e.harness import PROGRAMS, child_env
from tests.flodld.controller.prometheus import parse_strict

pytestmark = pytest.mark.multiproc

ROUNDS = 3
LATE_SECS = 0.5


async def _get_metrics(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()


async def _run_two_hosts(tmp_path: Path) -> tuple[Controller, bool, str, str]:
    token = secrets.token_hex(16)
    controller = Controller(
        ControllerOptions.model_validate(
            {
                "advertised_host": "127.0.0.1",
                "port": 0,
                "loopback_bind": True,
                "averaging": "cpu_sync",
                "run_id": "metrics-e2e",
                "env": {"FLODL_HEARTBEAT_INTERVAL_SECS": "0.1"},
                "join": JoinConfig(discovery=True, min_rank_start=2, target_ranks=2, token=token),
            }
        )
    )
    attach_data_plane(controller)
    _, port = await controller.start()
    log = tmp_path / "agents.log"
    agents = []
    with log.open("w") as sink:
        for host in ("node-a", "node-b"):
            spec = AgentSpec(
                host=host,
                controller_host="127.0.0.1",
                controller_port=port,
                salt_hex=token,
                devices=["cpu"],
                connect_attempts=5,
            )
            agents.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(PROGRAMS / "metrics_rounds.py"),
                    "--rounds",
                    str(ROUNDS),
                    "--late-rank",
                    "1",
                    "--late-secs",
                    str(LATE_SECS),
                    env={**child_env(), AGENT_ENV: encode_spec(spec)},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        try:
            result = await asyncio.wait_for(controller.wait(), 180)
            for agent in agents:
                await asyncio.wait_for(agent.wait(), 60)
            text = await _get_metrics(port)  # the verdict is in; the port still answers until close()
        finally:
            for agent in agents:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
            await controller.close()
    return controller, result.ok, text, log.read_text()


def test_metrics_of_a_real_two_host_run_parse_strictly_and_count_its_rounds(tmp_path: Path) -> None:
    controller, ok, text, output = asyncio.run(_run_two_hosts(tmp_path))
    assert ok, output
    assert output.count(f"{ROUNDS} rounds ok") == 2, output
    families = parse_strict(text)
    who = {"run_id": "metrics-e2e"}
    assert families["flodld_run_info"].value(**who) == 1
    assert families["flodld_phase"].value(phase="done") == 1
    assert families["flodld_rounds_total"].value(**who) == ROUNDS
    duration = families["flodld_round_duration_seconds"]
    assert duration.value("flodld_round_duration_seconds_count", **who) == ROUNDS
    # Rank 1 deposits LATE_SECS after rank 0 in every round after the first (in the first, the ranks'
    # start-up decides who is first): the rounds and its delays show it.
    least = (ROUNDS - 1) * LATE_SECS * 0.8
    assert duration.value("flodld_round_duration_seconds_sum", **who) >= least
    delays = families["flodld_rank_deposit_delay_seconds"]
    late = delays.value("flodld_rank_deposit_delay_seconds_sum", rank="1", **who)
    early = delays.value("flodld_rank_deposit_delay_seconds_sum", rank="0", **who)
    assert late >= least and early < late, (early, late)
    for rank in ("0", "1"):
        assert delays.value("flodld_rank_deposit_delay_seconds_count", rank=rank, **who) == ROUNDS
        assert families["flodld_rank_rounds_total"].value(rank=rank, **who) == ROUNDS
    # 8 float32 (32 bytes) up from each host and down to each host, every round.
    assert families["flodld_dataplane_received_bytes_total"].value(**who) == ROUNDS * 2 * 32
    assert families["flodld_dataplane_sent_bytes_total"].value(**who) == ROUNDS * 2 * 32
    assert families["flodld_join_admissions_total"].value(**who) == 2
    assert families["flodld_join_admitted_ranks_total"].value(**who) == 2
    assert families["flodld_lost_ranks"].value(**who) == 0
    assert families["flodld_run_restarts"].value(**who) == 0
    assert families["flodld_connections_total"].value(channel="data") >= 2
    assert controller.salt_hex not in text
