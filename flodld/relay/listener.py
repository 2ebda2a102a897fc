"""The relay's loopback listener for ranks: everything a rank leg goes through before its RankHello.

It serves only connections whose peer socket belongs to the relay's own uid (`flodld.net.peeruid`, where
/proc/net/tcp exists), holds at most `max_pending_rank_legs` legs mid-handshake, counts what each sends
before its RankHello verifies against the pre-auth allowance and a budget of that many allowances
(`flodld.net.preauth`), and drops a leg that has not proved the salt by `RANK_PREAUTH_DEADLINE_SECS`.
A leg that got that far is handed, with its channel and hello, to the relay (`flodld.relay.server`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import cast

from flodld.net.peeruid import peer_uid_known_here, socket_owner_uid
from flodld.net.preauth import PREAUTH_CONNECTION_BYTES, GatedReader, PreAuthBudget
from flodld.net.stream import FramedStream, accept_channel, read_channel_prefix
from flodld.wire.errors import WireError
from flodld.wire.magic import Channel
from flodld.wire.messages import Message

log = logging.getLogger("flodld.relay")

RANK_PREAUTH_DEADLINE_SECS = 10.0
"""From accept to a verified RankHello: a rank leg that has not proved the salt by then is dropped."""
RANK_LEG_STREAM_LIMIT = 1 << 16  # asyncio's default, as `start_server` used

RankLegService = Callable[[Channel, FramedStream, Message], Awaitable[None]]
"""What serves a leg once its first message (the RankHello, unchecked) is read: the relay's."""


def max_pending_rank_legs(ranks: int) -> int:
    """Rank legs allowed to be mid-handshake at once: both legs of every rank, plus slack for retries."""
    return 2 * ranks + 16


def leg_end_level(error: BaseException) -> int:
    """How loud a rank leg's end is: DEBUG for the way a leaving rank's socket ends (EOF, or a reset or
    broken pipe when it exits with bytes unread), INFO for anything else. A rank's exit, clean or not,
    is reported by its agent; this line would only repeat it for every rank of every clean run.
    """
    leaving = isinstance(error, EOFError | ConnectionResetError | BrokenPipeError)
    return logging.DEBUG if leaving else logging.INFO


class _RankLegProtocol(asyncio.StreamReaderProtocol):
    """A rank leg's stream protocol that keeps its transport, so a pre-auth overrun can abort it."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream socket's transport
        super().connection_made(transport)


class RankListener:
    """The pre-authentication of the rank legs of one relay (`protocol` is the server's factory)."""

    def __init__(self, ranks: int, salt: bytes, serve: RankLegService) -> None:
        self.salt = salt
        self.serve = serve
        self.rank_uid = os.getuid()
        self.preauth_deadline = RANK_PREAUTH_DEADLINE_SECS
        self.max_pending_legs = max_pending_rank_legs(ranks)
        self.preauth_budget = PreAuthBudget(self.max_pending_legs * PREAUTH_CONNECTION_BYTES)
        self.pending_legs = 0
        self.dropped: Counter[str] = Counter()

    def protocol(self) -> _RankLegProtocol:
        """A fresh loopback connection: its reader counts what it sends against the pre-auth bounds."""
        loop = asyncio.get_running_loop()
        protocol: _RankLegProtocol | None = None

        def overrun(code: str, detail: str) -> None:
            self.drop(code, detail)
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()

        reader = GatedReader(
            Channel.DATA,  # a placeholder: accept_channel is told the leg's channel read from its magic
            self.preauth_budget,
            limit=RANK_LEG_STREAM_LIMIT,
            loop=loop,
            overrun=overrun,
        )
        protocol = _RankLegProtocol(reader, self._serve_leg, loop=loop)
        return protocol

    def drop(self, code: str, detail: str) -> None:
        """Count a loopback connection dropped before its hello; log the first of each kind (a flood of them
        must not become a flood of log lines).
        """
        self.dropped[code] += 1
        if self.dropped[code] == 1:
            log.warning("relay: dropped a loopback connection before its hello (%s): %s", code, detail)
        else:
            log.debug("relay: dropped a loopback connection before its hello (%s): %s", code, detail)

    def _peer_refusal(self, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        """Why this connection is not served before a byte of it is read, or None."""
        if self.pending_legs >= self.max_pending_legs:
            return "pending_cap", f"{self.max_pending_legs} loopback connections are mid-handshake already"
        if not peer_uid_known_here():
            return None  # no /proc/net/tcp: the loopback bind, the cap, the budget and the deadline bound it
        peer, ours = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        owner = socket_owner_uid((peer[0], peer[1]), (ours[0], ours[1])) if peer and ours else None
        if owner != self.rank_uid:
            whose = f"uid {owner}" if owner is not None else "an unknown owner"
            return "peer_uid", f"its socket belongs to {whose} (only the ranks' uid {self.rank_uid} may dial)"
        return None

    async def _serve_leg(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One rank leg's task. Cancelled when the relay stops (SIGTERM): that ends the leg quietly,
        since the streams callback that owns this task would log a cancelled handler as an error.
        """
        try:
            admitted = await self._admit(reader, writer)
            if admitted is not None:
                await self.serve(*admitted)
        except asyncio.CancelledError:
            writer.close()
        finally:
            if isinstance(reader, GatedReader):
                reader.settle()  # whatever it still held goes back to the pre-auth budget

    async def _admit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Channel, FramedStream, Message] | None:
        """The leg's channel, stream and first message, or None (the leg dropped and counted)."""
        refused = self._peer_refusal(writer)
        if refused is not None:
            self.drop(*refused)
            writer.transport.abort()  # nothing read, nothing sent
            return None
        self.pending_legs += 1
        try:
            # One deadline for the whole pre-authentication: magic, key exchange and RankHello.
            async with asyncio.timeout(self.preauth_deadline):
                channel, _ = await read_channel_prefix(reader, timeout=self.preauth_deadline)
                if channel not in (Channel.DATA, Channel.CONTROL):
                    self.drop("unknown_magic", "not a DATA or CONTROL leg")
                    writer.close()
                    return None
                stream = await accept_channel(
                    reader, writer, self.salt, channel=channel, timeout=self.preauth_deadline
                )
                hello = (await stream.recv(self.preauth_deadline)).message()
        except (TimeoutError, EOFError, OSError, WireError, asyncio.IncompleteReadError) as error:
            if not (isinstance(reader, GatedReader) and reader.refused):  # an overrun was counted already
                self.drop(type(error).__name__, str(error) or "no hello before the deadline")
            writer.transport.abort()
            return None
        finally:
            self.pending_legs -= 1
        return channel, stream, hello
