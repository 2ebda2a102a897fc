"""Issue 21: a recording forwarder between two real `fdl join` walk-ins (agent, relay, rank each) and a
real controller (`fdl run`) sees the join, rendezvous, data and control channels, and none of their
plaintext: not the hosts' names from their Hellos, not the tensor the ranks average, not the average.

Two hosts, so the round crosses the controller (the relay of a world's only host broadcasts its own fold).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch

from flodld.wire.magic import Channel, magic_prefix
from tests.e2e.harness import Fdl, child_env, free_port, write_discovery_project
from tests.flodld.relay.recorder import RecordingForwarder

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).resolve().parent / "programs" / "known_tensor.py"
HOSTS = ("walkin-secret-hostname-a", "walkin-secret-hostname-b")


def pattern(value: float) -> bytes:
    return torch.full((8,), value, dtype=torch.float32).numpy().tobytes()


def test_an_observer_on_the_path_to_the_controller_sees_no_plaintext_on_any_channel(tmp_path: Path) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(tmp_path, port, token, ranks=2)
    run = Fdl("run", "--project", str(project), str(PROGRAM))
    forwarder = RecordingForwarder(port)
    try:
        run.wait_for(r"waiting — window open")
        walks = [
            Fdl("join", f"127.0.0.1:{forwarder.port}", "--bin", str(PROGRAM), "--host", host,
                "--devices", "cpu:1", env=child_env(FDL_JOIN_TOKEN=token))
            for host in HOSTS
        ]
        for walk in walks:
            assert walk.wait() == 0, walk.output
        assert run.wait() == 0, run.output
    finally:
        forwarder.close()
        run.kill()
    assert sum(walk.output.count("known tensor mean ok") for walk in walks) == 2, [w.output for w in walks]

    transcripts = forwarder.recorded()
    for channel in (Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL):
        assert any(t.startswith(magic_prefix(channel)) for t in transcripts), channel
    wire = b"\x00".join(transcripts)
    assert sum(len(t) for t in transcripts) > 2 * 4096 * 4  # both deposits and the broadcasts crossed it
    assert not any(host.encode() in wire for host in HOSTS)
    for value in (1234.5, 1235.5, 1235.0):  # each rank's deposit, and the mean
        assert pattern(value) not in wire, value
    assert token.encode() not in wire and bytes.fromhex(token) not in wire
