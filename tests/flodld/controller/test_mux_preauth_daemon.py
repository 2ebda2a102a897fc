"""Issue 13 point 5 against a real `flodld serve`: peers without the salt cannot make the daemon buffer.

Before the fix, six unauthenticated rendezvous connections, each claiming a 16 MiB payload and
streaming it, took the controller from 51 to 563 MiB. Now the first frame of every channel is capped
small (no tail) until the peer proves the key, and every pre-authentication byte is counted against
a per-connection allowance and a global budget.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from flodld.net.stream import open_channel
from flodld.wire.data import HelloAck
from flodld.wire.frames import FRAME_MAGIC, HEADER, NONCE_BYTES, PROTOCOL_VERSION
from flodld.wire.join import Accept, WorldFormed
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.salt import salt_from_hex
from tests.flodld.controller.relays import agent_host_key, open_relay
from tests.reliability.daemon import hello, state
from tests.reliability.process import DaemonProcess, raise_fd_limit

pytestmark = pytest.mark.multiproc

PER_CHANNEL = 8
STREAM_BYTES = 8 * 1024 * 1024  # what each hostile connection tries to push after its header
CHUNK = 256 * 1024
RSS_SLACK = 32 * 1024 * 1024  # "within a few tens of MiB of idle"


async def _hostile(port: int, channel: Channel) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """No salt: a random nonce, a header claiming the largest frame, then as many bytes as we can push."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(magic_prefix(channel) + secrets.token_bytes(NONCE_BYTES))
    try:
        await asyncio.wait_for(reader.readexactly(NONCE_BYTES), 5)
        writer.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0x0201, 0, 16 * 1024 * 1024 - 1, 2**30))
        junk = b"\xa5" * CHUNK
        for _ in range(STREAM_BYTES // CHUNK):
            writer.write(junk)
            await asyncio.wait_for(writer.drain(), 5)
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
        pass
    return reader, writer


async def test_unauthenticated_floods_on_every_channel_leave_rss_near_idle_and_the_daemon_serving(
    tmp_path: Path,
) -> None:
    raise_fd_limit(1024)
    daemon = DaemonProcess(tmp_path, target=1, min_ranks=1)
    try:
        port, salt = daemon.port, salt_from_hex(daemon.token)
        # Form a one-host cpu_sync world so DATA and CONTROL are served too; the agent's link stays open.
        agent = await open_channel("127.0.0.1", port, Channel.JOIN, salt, timeout=10)
        await agent.send(hello("h"))
        assert isinstance((await agent.recv(10)).message(), Accept)
        formed = (await agent.recv(20)).message()
        assert isinstance(formed, WorldFormed)
        for _ in range(200):
            if (await state(port))["phase"] == "training":
                break
            await asyncio.sleep(0.05)
        for _ in range(5):
            await state(port)
        # A one-host world's relay folds its own rounds, so this controller never loads torch for a fold
        # (tests/flodld/relay/test_relay_preload.py): nothing loads inside the measured window.
        await asyncio.sleep(0.3)
        idle = daemon.rss_bytes()

        channels = [Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL]
        held = await asyncio.gather(
            *(_hostile(port, channel) for channel in channels for _ in range(PER_CHANNEL))
        )
        await asyncio.sleep(0.5)
        loaded = daemon.rss_bytes()  # while every hostile connection is still open on our side
        grew = loaded - idle
        print(
            f"daemon RSS idle {idle / 2**20:.1f} MiB, under {len(held)} hostile connections "
            f"{loaded / 2**20:.1f} MiB (+{grew / 2**20:.1f} MiB)"
        )
        assert grew < RSS_SLACK, f"RSS grew by {grew / 2**20:.1f} MiB under unauthenticated floods"

        body = await state(port)
        assert body["phase"] == "training"
        # Still serving the run: the host's relay is admitted on DATA.
        key = agent_host_key(salt, "h", formed.envelope.run_id, agent.conn)
        relay, reply = await open_relay(
            port, salt, key, Channel.DATA, host="h", ranks=list(formed.envelope.ranks)
        )
        assert isinstance(reply, HelloAck), reply
        await relay.aclose()
        for _, writer in held:
            writer.close()
        await agent.aclose()
        assert daemon.proc.poll() is None
    finally:
        daemon.kill()
