"""A relay's side of the DATA and CONTROL channels, as a test speaks it: proves a host key, then rekeys."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.run import Controller
from flodld.membership.phase import Phase
from flodld.net.stream import FramedStream, open_channel
from flodld.wire.data import HelloAck, RelayHello
from flodld.wire.frames import FrameConnection
from flodld.wire.hostkey import join_host_key, relay_proof
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

from .agents import Agent, eventually, join, options


def agent_host_key(salt: bytes, host: str, run_id: str, join_conn: FrameConnection) -> bytes:
    """What the agent of `host` derives from its own join connection (and hands its relay)."""
    return join_host_key(salt, host=host, run_id=run_id, conn=join_conn)


async def open_relay(
    port: int, salt: bytes, host_key: bytes, channel: Channel, *, host: str, ranks: list[int]
) -> tuple[FramedStream, Message]:
    """Dial `channel`, send RelayHello for `host` proven with `host_key`; on HelloAck rekey to it."""
    stream = await open_channel("127.0.0.1", port, channel, salt, timeout=5)
    listener_nonce = stream.conn.peer_nonce
    assert listener_nonce is not None
    proof = relay_proof(
        host_key, host=host, channel=channel, dialer_nonce=stream.conn.nonce, listener_nonce=listener_nonce
    )
    await stream.send(RelayHello(host=host, ranks=ranks, proof=proof))
    reply = (await stream.recv(5)).message()
    if isinstance(reply, HelloAck):
        stream.rekey(host_key)
    return stream, reply


@dataclass
class TwoHosts:
    controller: Controller
    port: int
    agents: dict[str, Agent]
    keys: dict[str, bytes]


@asynccontextmanager
async def two_hosts(environ: dict[str, str] | None = None) -> AsyncIterator[TwoHosts]:
    """A formed cpu_sync world of hosts "a" (rank 0) and "b" (rank 1); both join links stay open.
    `environ`: the run's env as the data plane reads it (liveness timeouts).
    """
    opts = options(
        capacity=2, averaging="cpu_sync", join=JoinConfig(join_timeout=30, target_ranks=2, min_rank_start=2)
    )
    controller = Controller(opts)
    attach_data_plane(controller, environ=environ or {})
    _, port = await controller.start()
    try:
        agents = {host: await join(port, controller.salt, host) for host in ("a", "b")}
        for agent in agents.values():
            await agent.world()
        await eventually(lambda: controller.phase is Phase.TRAINING, timeout=5)
        keys = {
            host: agent_host_key(controller.salt, host, controller.run_id, agent.stream.conn)
            for host, agent in agents.items()
        }
        yield TwoHosts(controller, port, agents, keys)
    finally:
        await controller.close()
