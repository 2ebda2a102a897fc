"""Control-plane messages (kinds 0x04xx): liveness between ranks and the controller, via the relay.

The relay forwards `Heartbeat` upstream and `CoordinatorHeartbeat`, `DeclareDead` and `Shutdown`
down. Any inbound frame proves the controller alive to a rank; a rank that hears nothing for its
liveness timeout ends itself instead of hanging in a collective.
"""

from __future__ import annotations

from flodld.wire.messages import Count, Message, Rank, Reason, register


@register(0x0401)
class Heartbeat(Message):
    """Rank → controller: still alive, at `step` (the rank's own counter of completed rounds)."""

    rank: Rank
    step: Count


@register(0x0402)
class CoordinatorHeartbeat(Message):
    """Controller → every rank: the coordinator is alive."""


@register(0x0403)
class DeclareDead(Message):
    """Controller → relay: `rank` went silent past the heartbeat timeout; fold it out and cut its legs."""

    rank: Rank
    reason: Reason


@register(0x0404)
class Shutdown(Message):
    """Controller → relay → ranks: the run is over (or failed); stop now."""

    reason: Reason
