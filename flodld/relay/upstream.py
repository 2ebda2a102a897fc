"""The relay's two upstreams to the controller (DATA and CONTROL): dialed, proved with the host key, and
rekeyed as this host once the controller's HelloAck came. Encrypted (wire protocol v2): see
`warn_if_public` for what that is worth on a public path.
"""

from __future__ import annotations

import logging

from flodld.net.addresses import is_private_address
from flodld.net.keepalive import keep_alive
from flodld.net.stream import FramedStream, connect_with_retry
from flodld.relay.spec import RelayRoleSpec
from flodld.wire.data import HelloAck, RelayHello
from flodld.wire.hostkey import relay_proof
from flodld.wire.magic import Channel

log = logging.getLogger("flodld.relay")

HANDSHAKE_TIMEOUT_SECS = 10.0


def warn_if_public(peer: str, where: str) -> bool:
    """Log a warning when the controller's address is outside every private range; True if it did.

    The upstreams are encrypted (wire protocol v2), so the warning is about the salt they are keyed from:
    private only while the salt is (a configured join token; under open admission it crossed the path).
    """
    if is_private_address(peer):  # loopback included
        return False
    log.warning(
        "relay: WARNING: controller %s (peer %s) is outside every private address range. The relay's DATA "
        "and "
        "CONTROL upstreams to it are encrypted (AEAD, keys from the run salt and this host's admission), so "
        "they "
        "are private only while the salt is: with a configured join token; under open admission the salt "
        "crossed "
        "the path in the join's Accept, readable by whoever watched it. Process-group traffic (gloo/NCCL) is "
        "not "
        "flodld's and stays cleartext. Use a tunnel (`tunnel: true`, `fdl join --ssh`) or a VPN when in "
        "doubt",
        where,
        peer,
    )
    return True


async def dial_controller(
    spec: RelayRoleSpec, channel: Channel, *, host_key: bytes, warn_public: bool
) -> tuple[FramedStream, HelloAck, bool]:
    """One upstream, through its HelloAck and rekeyed as this host; and whether it warned of a public
    controller address (only with `warn_public`: once per relay is enough).
    """
    stream = await connect_with_retry(
        spec.controller_host,
        spec.controller_port,
        channel,
        bytes.fromhex(spec.salt_hex),
        what=f"relay {channel} upstream",
        attempts=spec.connect_attempts,
    )
    keep_alive(stream.writer)  # a vanished controller ends the relay's upstream reader with an error
    peer = stream.writer.get_extra_info("peername")
    warned = (
        bool(peer)
        and warn_public
        and warn_if_public(str(peer[0]), f"{spec.controller_host}:{spec.controller_port}")
    )
    listener_nonce = stream.conn.peer_nonce
    assert listener_nonce is not None  # the handshake completed
    proof = relay_proof(
        host_key,
        host=spec.host,
        channel=channel,
        dialer_nonce=stream.conn.nonce,
        listener_nonce=listener_nonce,
    )
    await stream.send(RelayHello(host=spec.host, ranks=sorted(spec.ranks), proof=proof))
    reply = (await stream.recv(HANDSHAKE_TIMEOUT_SECS)).message()
    if not isinstance(reply, HelloAck):
        raise ConnectionError(f"controller refused the relay's {channel} channel: {reply!r}")
    stream.rekey(host_key)  # the controller rekeyed after its HelloAck: from here on, as this host
    return stream, reply, warned
