"""The relay's loopback listener for ranks is bounded like the controller's port (issue 29, point 8).

Real relay, real controller data plane (the sole-host world of test_relay_sole_host). A connection from
another uid is closed before the relay reads or sends a byte; connections that never prove the salt are
capped in number and in bytes and dropped at the pre-auth deadline, while real ranks still connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from flodld.controller.dataplane import DataPlane
from flodld.controller.mux import PortMux
from flodld.controller.status.metrics import ControllerCounters
from flodld.net.preauth import PREAUTH_CONNECTION_BYTES
from flodld.relay.server import Relay
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.magic import CHANNEL_MAGICS, Channel
from tests.flodld.relay.recorder import RecordingForwarder
from tests.flodld.relay.test_relay_sole_host import HOST, HOST_KEY, RANKS, SALT, World, leg

DATA_MAGIC = CHANNEL_MAGICS[Channel.DATA].to_bytes(4, "little")


@pytest.fixture
async def world() -> AsyncIterator[World]:
    """The sole-host world, with a liveness timeout long enough that ranks may connect late."""
    plane = DataPlane(SALT, {HOST: RANKS}, host_key={HOST: HOST_KEY}.get, liveness_timeout=120.0,
                      heartbeat_interval=0.2, on_rank_dead=lambda rank, why: None)  # fmt: skip
    mux = PortMux(ControllerCounters())
    mux.register(Channel.DATA, plane.handle_data)
    mux.register(Channel.CONTROL, plane.handle_control)
    _, port = await mux.start("127.0.0.1", 0)
    plane.start()
    upstream = RecordingForwarder(port)
    listener = socket.create_server(("127.0.0.1", 0))
    relay_port = listener.getsockname()[1]
    spec = RelayRoleSpec(host=HOST, controller_host="127.0.0.1", controller_port=upstream.port,
                         salt_hex=SALT.hex(), host_key_hex=HOST_KEY.hex(), ranks=RANKS,
                         listen_fd=listener.detach())  # fmt: skip
    relay = Relay(spec)
    task = asyncio.create_task(relay.run())
    try:
        yield World(plane, relay, task, relay_port, upstream, [])
    finally:
        relay.stop("test over", 0)
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()
        await mux.close()
        upstream.listener.close()

# Dial the relay, send the DATA magic, and print how many bytes came back before the close (the relay
# answers a rank of its uid with its key-exchange nonce).
_DIAL = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    s.sendall(bytes.fromhex(sys.argv[2]))
    try:
        reply = s.recv(64)
    except ConnectionResetError:
        reply = b""
    print("reply=%d" % len(reply), flush=True)
    """
)


async def _dial(argv: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd="/"
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


async def _silent(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the relay sent before it closed this connection (waits for the close)."""
    with contextlib.suppress(ConnectionError):
        return await reader.read()
    return b""


async def _until(predicate: object, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_another_uid_is_closed_before_a_byte_is_read_or_sent(world: World) -> None:
    # The relay is told it serves some other uid: this test's own real connection then comes from
    # "another uid", found as such in /proc/net/tcp.
    world.relay.listener.rank_uid = os.getuid() + 4242
    assert await _dial([sys.executable, "-c", _DIAL, str(world.relay_port), DATA_MAGIC.hex()]) == "reply=0"
    assert world.relay.listener.dropped["peer_uid"] == 1
    world.relay.listener.rank_uid = os.getuid()  # the ranks' own uid: served
    assert await _dial([sys.executable, "-c", _DIAL, str(world.relay_port), DATA_MAGIC.hex()]) != "reply=0"
    stream = await leg(world, Channel.CONTROL, 0)
    stream.close()


_SYSTEM_PYTHON = "/usr/bin/python3"  # the join user cannot run an interpreter under /root


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(_SYSTEM_PYTHON, os.X_OK),
    reason="needs root, setpriv and /usr/bin/python3 to be another uid",
)
async def test_a_connection_from_another_real_uid_is_refused(world: World) -> None:
    from tests.flodld.fanout.joinuser import as_join_user, join_user

    user = join_user()
    argv = as_join_user([_SYSTEM_PYTHON, "-c", _DIAL, str(world.relay_port), DATA_MAGIC.hex()], user)
    assert await _dial(argv) == "reply=0"
    assert world.relay.listener.dropped["peer_uid"] == 1
    stream = await leg(world, Channel.DATA, 1)  # a rank (this uid) is served
    stream.close()


async def test_silent_connections_are_capped_and_dropped_at_the_deadline_while_ranks_connect(
    world: World,
) -> None:
    relay = world.relay
    relay.listener.preauth_deadline = 5.0  # long enough that none of the held ones expires during the flood
    cap = relay.listener.max_pending_legs
    assert cap < 64  # a small, fixed number for a 3-rank host, not "unbounded"
    # Hold all but two slots with connections that never send a byte; rank 0's two legs still connect.
    held = [await _silent(world.relay_port) for _ in range(cap - 2)]
    await _until(lambda: relay.listener.pending_legs == cap - 2)
    legs = [await leg(world, channel, 0) for channel in (Channel.DATA, Channel.CONTROL)]
    # A flood past the cap: the relay holds `cap` at most and closes the rest at once, unread.
    flood = [await _silent(world.relay_port) for _ in range(2 * cap)]
    await _until(lambda: relay.listener.dropped["pending_cap"] == 2 * cap - 2)
    assert relay.listener.pending_legs == cap
    assert relay.listener.preauth_budget.limit == cap * PREAUTH_CONNECTION_BYTES
    # Every silent one is closed by the deadline, the relay having sent none of them a byte.
    replies = await asyncio.wait_for(asyncio.gather(*(_closed(r) for r, _ in held + flood)), 60)
    assert set(replies) == {b""}
    await _until(lambda: relay.listener.pending_legs == 0)
    assert relay.listener.preauth_budget.used == 0
    later = [await leg(world, channel, 1) for channel in (Channel.DATA, Channel.CONTROL)]
    for stream in legs + later:
        stream.close()
    for _, writer in held + flood:
        writer.close()


async def test_a_leg_that_sends_more_than_its_preauth_allowance_is_cut(world: World) -> None:
    reader, writer = await _silent(world.relay_port)
    writer.write(DATA_MAGIC + os.urandom(PREAUTH_CONNECTION_BYTES + 4096))
    await asyncio.wait_for(_closed(reader), 30)
    writer.close()
    await _until(lambda: world.relay.listener.pending_legs == 0)
    assert world.relay.listener.dropped["preauth_overrun"] + world.relay.listener.dropped["WireError"] == 1
    assert world.relay.listener.preauth_budget.used == 0
    stream = await leg(world, Channel.DATA, 2)
    stream.close()
