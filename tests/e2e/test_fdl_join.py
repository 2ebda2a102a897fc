"""`fdl join` walk-ins against a controller started by `fdl run` on a roster-free (discovery) window."""

from __future__ import annotations

import json
import re
import secrets
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from flodld.wire.magic import Channel, magic_prefix
from tests.e2e.harness import (
    EXAMPLES,
    PROGRAMS,
    Fdl,
    child_env,
    free_port,
    write_discovery_project,
)
from tests.flodld.relay.recorder import RecordingForwarder

pytestmark = pytest.mark.multiproc


def state(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=10) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def joined_hosts(port: int) -> list[str]:
    hosts = state(port).get("members", [])
    assert isinstance(hosts, list)
    return [str(entry["host"]) for entry in hosts]


def test_two_walk_ins_form_a_world_fold_through_their_relays_and_one_dials_through_a_forwarder(
    tmp_path: Path,
) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(tmp_path, port, token, ranks=4)
    program = str(PROGRAMS / "walkin.py")
    run = Fdl("run", "--project", str(project), program)
    run.wait_for(r"waiting — window open")

    wrong = Fdl(
        "join",
        f"127.0.0.1:{port}",
        "--token",
        secrets.token_hex(16),
        "--bin",
        program,
        "--host",
        "intruder",
        "--devices",
        "cpu",
    )
    assert wrong.wait() == 2, wrong.output
    assert "token mismatch" in wrong.output

    env = child_env(FDL_JOIN_TOKEN=token)  # the token stays out of every command line
    walk_a = Fdl(
        "join", f"127.0.0.1:{port}", "--bin", program, "--host", "walk-a", "--devices", "cpu:2", env=env
    )
    forwarder = RecordingForwarder(port)  # an `ssh -L`-like road for walk-b
    try:
        deadline = time.monotonic() + 120
        while "walk-a" not in joined_hosts(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert joined_hosts(port) == ["walk-a"], state(port)
        status = Fdl("status", "--addr", f"127.0.0.1:{port}")
        assert status.wait() == 0, status.output
        assert "walk-a" in status.output and "waiting" in status.output, status.output
        walk_b = Fdl(
            "join",
            f"127.0.0.1:{forwarder.port}",
            "--bin",
            program,
            "--host",
            "walk-b",
            "--devices",
            "cpu:2",
            env=env,
        )
        assert walk_a.wait() == 0, walk_a.output
        assert walk_b.wait() == 0, walk_b.output
        assert run.wait() == 0, run.output
    finally:
        forwarder.close()
        run.kill()

    assert re.findall(r"rank [01] controller=127\.0\.0\.1:(\d+)", walk_a.output) == [str(port)] * 2
    # Address rewrite: walk-b's relay and ranks dial the forwarder's ephemeral port, the road its join used.
    assert re.findall(r"rank [23] controller=127\.0\.0\.1:(\d+)", walk_b.output) == [str(forwarder.port)] * 2
    prefixes = {sent[:4] for sent in forwarder.recorded()[0::2]}  # each connection's dialer side
    for channel in (Channel.JOIN, Channel.DATA, Channel.CONTROL, Channel.RENDEZVOUS):
        assert magic_prefix(channel) in prefixes, channel
    for output in (walk_a.output, walk_b.output):
        assert "round 0 mean ok" in output
    assert len(re.findall(r"round 1 mean without rank 3 ok", walk_a.output + walk_b.output)) == 3


@pytest.mark.slow
def test_persist_loop_waits_for_a_controller_then_rejoins_the_next_run(tmp_path: Path) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(tmp_path, port, token, ranks=1)
    env = child_env(FDL_JOIN_TOKEN=token, FLODL_NET_TIMEOUT_SCALE="0.1")
    join = Fdl(
        "join",
        f"127.0.0.1:{port}",
        "--persist",
        "--bin",
        str(EXAMPLES / "allreduce.py"),
        "--host",
        "persistent",
        "--devices",
        "cpu",
        env=env,
    )
    try:
        join.wait_for(r"re-dialing in", timeout=120)  # no controller yet: transient, backs off
        for run_number in (1, 2):
            run = Fdl("run", "--project", str(project), str(EXAMPLES / "allreduce.py"))
            assert run.wait() == 0, run.output
            join.wait_for(r"run finished after \d+s; re-dialing", count=run_number, timeout=60)
        assert len(re.findall(r"world formed", join.output)) == 2
        assert join.process.poll() is None, "the persist loop gave up"
    finally:
        join.signal(signal.SIGTERM)
        join.kill()
