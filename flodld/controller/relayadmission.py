"""Who may speak for a host on the data plane: a relay's handshake, its hello check, and its seat.

A relay dials DATA or CONTROL and introduces itself with RelayHello. It is seated (one relay per host and
channel) only if its host is in this world, it claims exactly that host's ranks, and its `proof` verifies
under the key derived at that host's admission (`host_key(host)`): a relay speaks only for the host whose
agent started it. The HelloAck goes out under the session key; every later frame, both ways, is keyed to
that host (`rekey`). Every refusal is counted by reason (`refusals`, the controller's `dropped`) and
answered with a DataPlaneError naming it.

`RelayAdmission` is the data plane's door (controller/dataplane.py serves the seated relays' frames).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from flodld.net.stream import FramedStream, accept_channel
from flodld.wire.data import DataPlaneError, HelloAck, RelayHello
from flodld.wire.errors import WireError
from flodld.wire.hostkey import verify_relay_proof
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

# The data plane's log: a relay's admission reads among the plane's other events.
log = logging.getLogger("flodld.controller.dataplane")

HANDSHAKE_TIMEOUT_SECS = 10.0


class RelayAdmission:
    """The relays seated on each channel (`relays[channel][host]`) and the checks that seat them."""

    def __init__(
        self,
        salt: bytes,
        host_ranks: Mapping[str, Sequence[int]],
        *,
        host_key: Callable[[str], bytes | None],
        refusals: Counter[str],
        sole_host: bool,
    ) -> None:
        self.salt = salt
        self.host_ranks = host_ranks  # the plane's: a walk-in's host is added there when it is expected
        self.host_key = host_key
        self.refusals = refusals
        self.sole_host = sole_host
        self.relays: dict[Channel, dict[str, FramedStream]] = {Channel.DATA: {}, Channel.CONTROL: {}}

    async def handshake(
        self, channel: Channel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[FramedStream, Message] | None:
        """The keyed stream and its first message (the relay's hello), or None when the handshake failed."""
        try:
            stream = await accept_channel(
                reader, writer, self.salt, channel=channel, timeout=HANDSHAKE_TIMEOUT_SECS
            )
            hello = (await stream.recv(HANDSHAKE_TIMEOUT_SECS)).message()
        except (TimeoutError, EOFError, OSError, WireError) as error:
            self.refusals[f"{channel.value}_handshake"] += 1
            log.info("event=relay_dropped channel=%s reason=%r", channel.value, str(error))
            return None
        return stream, hello

    async def admit(self, channel: Channel, stream: FramedStream, hello: Message) -> str | None:
        """Seat the relay and rekey its stream to its host's key: its host, or None when it was refused."""
        if not isinstance(hello, RelayHello):
            await self._refuse(channel, stream, f"expected RelayHello first, got {type(hello).__name__}")
            return None
        refusal = self.refusal(channel, stream, hello)
        if refusal is not None:
            await self._refuse(channel, stream, refusal)
            return None
        key = self.host_key(hello.host)
        assert key is not None  # checked by _proves_host_key
        self.relays[channel][hello.host] = stream
        try:
            await stream.send(HelloAck(sole_host=channel is Channel.DATA and self.sole_host))
        except BaseException:
            del self.relays[channel][hello.host]
            raise
        stream.rekey(key)  # every later frame in both directions is authenticated as this host's
        log.info(
            "event=relay_joined channel=%s host=%s ranks=%s", channel.value, hello.host, sorted(hello.ranks)
        )
        return hello.host

    def release(self, channel: Channel, host: str, stream: FramedStream) -> None:
        """The relay's connection ended: its seat is free (unless a newer relay holds it already)."""
        if self.relays[channel].get(host) is stream:
            del self.relays[channel][host]

    async def _refuse(self, channel: Channel, stream: FramedStream, refusal: str) -> None:
        self.refusals[f"{channel.value}_hello"] += 1
        log.warning("event=relay_refused channel=%s reason=%r", channel.value, refusal)
        with contextlib.suppress(OSError, WireError, TimeoutError):
            await stream.send(DataPlaneError(reason=refusal))

    def refusal(self, channel: Channel, stream: FramedStream, hello: RelayHello) -> str | None:
        """Why this relay's hello is refused, or None (the decision; `admit` acts on it)."""
        if hello.host not in self.host_ranks:
            return f"host {hello.host!r} is not in this world (hosts: {sorted(self.host_ranks)})"
        if not self._proves_host_key(channel, stream, hello):
            return (
                f"the relay's hello for host {hello.host!r} does not verify under that host's admission key: "
                "a relay speaks only for the host whose agent started it"
            )
        if sorted(hello.ranks) != self.host_ranks[hello.host]:
            owned = self.host_ranks[hello.host]
            return f"host {hello.host!r} claims ranks {sorted(hello.ranks)} but owns {owned}"
        if hello.host in self.relays[channel]:
            return f"host {hello.host!r} already has a relay on the {channel} channel"
        return None

    def _proves_host_key(self, channel: Channel, stream: FramedStream, hello: RelayHello) -> bool:
        key = self.host_key(hello.host)
        listener_nonce, dialer_nonce = stream.conn.nonce, stream.conn.peer_nonce
        if key is None or dialer_nonce is None:
            return False
        return verify_relay_proof(
            key,
            hello.proof,
            host=hello.host,
            channel=channel,
            dialer_nonce=dialer_nonce,
            listener_nonce=listener_nonce,
        )
