"""Issue 21: a recording forwarder between a real `fdl join` walk-in (agent, relay, ranks) and a real
controller (`fdl run`) sees the join, rendezvous, data and control channels, and none of their plaintext:
not the host's name from its Hello, not the tensor the ranks average, not the average.
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
HOST = "walkin-secret-hostname"


def pattern(value: float) -> bytes:
    return torch.full((8,), value, dtype=torch.float32).numpy().tobytes()


def test_an_observer_on_the_path_to_the_controller_sees_no_plaintext_on_any_channel(tmp_path: Path) -> None:
    port, token = free_port(), secrets.token_hex(16)
    project = write_discovery_project(tmp_path, port, token, ranks=2)
    run = Fdl("run", "--project", str(project), str(PROGRAM))
    forwarder = RecordingForwarder(port)
    try:
        run.wait_for(r"waiting — window open")
        walk = Fdl("join", f"127.0.0.1:{forwarder.port}", "--bin", str(PROGRAM), "--host", HOST,
                   "--devices", "cpu:2", env=child_env(FDL_JOIN_TOKEN=token))
        assert walk.wait() == 0, walk.output
        assert run.wait() == 0, run.output
    finally:
        forwarder.close()
        run.kill()
    assert walk.output.count("known tensor mean ok") == 2, walk.output

    transcripts = forwarder.recorded()
    for channel in (Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL):
        assert any(t.startswith(magic_prefix(channel)) for t in transcripts), channel
    wire = b"\x00".join(transcripts)
    assert sum(len(t) for t in transcripts) > 2 * 4096 * 4  # both deposits and the broadcasts crossed it
    assert HOST.encode() not in wire
    for value in (1234.5, 1235.5, 1235.0):  # each rank's deposit, and the mean
        assert pattern(value) not in wire, value
    assert token.encode() not in wire and bytes.fromhex(token) not in wire
