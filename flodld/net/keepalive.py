"""TCP liveness for the links a host keeps to its controller (the agent's join link, the relay's upstreams).

The join protocol is silent during training, and a network that vanishes sends neither FIN nor RST, so
without help a host would wait on a dead controller for ever. Keepalive probes start after `idle` s of
silence, every idle/3 s, and three unanswered ones fail the read; TCP_USER_TIMEOUT bounds unacknowledged
writes the same way, so a link that is busy sending (a relay's heartbeats) is covered too. Either way the
read ends with an OSError within about 2 * idle s of the network going away.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from flodld.net.timeouts import scaled

LINK_KEEPALIVE_SECS = 15.0  # unscaled; the same default as the controller's side of the join link
KEEPALIVE_PROBES = 3


def dead_link_bound_secs(idle: float | None = None) -> float:
    """How long a vanished network goes unnoticed at most (scaled): idle plus the probes."""
    idle = scaled(LINK_KEEPALIVE_SECS) if idle is None else idle
    return 2 * max(1, round(idle))


def keep_alive(writer: asyncio.StreamWriter, idle: float | None = None) -> bool:
    """Enable keepalive (idle: seconds, default the scaled LINK_KEEPALIVE_SECS) on the writer's TCP socket.

    Returns False where the socket is not TCP or the platform lacks the options (nothing is changed then).
    """
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    seconds = max(1, round(scaled(LINK_KEEPALIVE_SECS) if idle is None else idle))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, seconds)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(seconds / KEEPALIVE_PROBES)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    except (OSError, AttributeError):  # the TCP_KEEP* names are Linux/BSD only
        return False
    with contextlib.suppress(OSError, AttributeError):  # Linux only: bounds unacknowledged writes
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_link_bound_secs(seconds) * 1000)
        )
    return True
