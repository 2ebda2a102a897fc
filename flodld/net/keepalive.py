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
import sys
import typing
from dataclasses import dataclass

from flodld.net.timeouts import scaled

LINK_KEEPALIVE_SECS = 15.0  # unscaled; the same default as the controller's side of the join link
KEEPALIVE_PROBES = 3


def dead_link_bound_secs(idle: float | None = None) -> float:
    """How long a vanished network goes unnoticed at most (scaled): idle plus the probes."""
    idle = scaled(LINK_KEEPALIVE_SECS) if idle is None else idle
    return 2 * max(1, round(idle))


def keepalive_options(idle: float) -> tuple[tuple[int, int, int], ...]:
    """The (level, option, value) triples of keepalive after `idle` s of silence: probes every idle/3 s,
    three unanswered ones fail the read. Empty where the platform lacks the TCP_KEEP* names (Linux/BSD only).
    """
    names = ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")
    if not all(hasattr(socket, name) for name in names):
        return ()
    seconds = max(1, round(idle))
    return (
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, seconds),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(seconds / KEEPALIVE_PROBES))),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES),
    )


def set_options(sock: socket.socket, options: tuple[tuple[int, int, int], ...]) -> bool:
    """Set every option on `sock`; False (what was set stays set) where one is refused or none exist."""
    if not options:
        return False
    try:
        for level, name, value in options:
            sock.setsockopt(level, name, value)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Inherited:
    """The TCP options every connection accepted on a listening socket starts with, set once on the listener.

    Linux copies a listening socket's TCP state (TCP_NODELAY, SO_KEEPALIVE and the TCP_KEEP* timings) into
    each socket it accepts, so a server that wants them on every connection pays four or five system calls
    once instead of per connection (and no socket object per connection to make them). Elsewhere nothing is
    assumed inherited: `listen_with` gives the empty answer and each connection sets its own.
    """

    nodelay: bool = False
    keepalive: float | None = None
    """The keepalive idle time (s, as `keepalive_options` rounds it) every accepted socket has, or None."""

    def keeps_alive(self, idle: float) -> bool:
        """Whether accepted sockets already probe as `keepalive_options(idle)` says."""
        return self.keepalive is not None and self.keepalive == max(1, round(idle))


def listen_with(listeners: list[socket.socket], keepalive: float | None) -> Inherited:
    """TCP_NODELAY and (when `keepalive` is given) keepalive on every listening socket; what accepted
    connections may then take as theirs. Nothing is claimed unless every listener took every option.
    """
    if not sys.platform.startswith("linux"):
        return Inherited()
    tcp = [sock for sock in listeners if sock.family in (socket.AF_INET, socket.AF_INET6)]
    if not tcp or len(tcp) != len(listeners):
        return Inherited()
    nodelay = all(set_options(sock, ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)) for sock in tcp)
    if keepalive is None:
        return Inherited(nodelay=nodelay)
    options = keepalive_options(keepalive)
    alive = all([set_options(sock, options) for sock in tcp])
    # Inherited too: a link the controller writes to when its network goes (a KillRank, an Abort) would
    # otherwise retransmit for many minutes, and keepalive never probes a socket with data in flight.
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if alive and user_timeout is not None:
        bound = int(dead_link_bound_secs(max(1, round(keepalive))) * 1000)
        for sock in tcp:
            set_options(sock, ((socket.IPPROTO_TCP, user_timeout, bound),))
    return Inherited(nodelay=nodelay, keepalive=float(max(1, round(keepalive))) if alive else None)


def tcp_socket(carrier: asyncio.BaseTransport | asyncio.StreamWriter) -> socket.socket | None:
    """The TCP socket under a transport or stream writer; None when there is none or it is not TCP."""
    sock = carrier.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return typing.cast(socket.socket, sock)


def keep_alive(
    carrier: asyncio.BaseTransport | asyncio.StreamWriter,
    idle: float | None = None,
    *,
    user_timeout: bool = True,
) -> bool:
    """Enable keepalive (idle: seconds, default the scaled LINK_KEEPALIVE_SECS) on a transport's or stream
    writer's TCP socket, and with `user_timeout` TCP_USER_TIMEOUT too (Linux only: bounds unacknowledged
    writes, for a link that is busy sending when its network goes).

    Returns False where the socket is not TCP or the platform lacks the options (nothing is changed then).
    """
    sock = tcp_socket(carrier)
    if sock is None:
        return False
    seconds = max(1, round(scaled(LINK_KEEPALIVE_SECS) if idle is None else idle))
    if not set_options(sock, keepalive_options(seconds)):
        return False
    if not user_timeout:
        return True
    with contextlib.suppress(OSError, AttributeError):  # Linux only: bounds unacknowledged writes
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_link_bound_secs(seconds) * 1000)
        )
    return True
