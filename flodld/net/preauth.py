"""Pre-authentication accounting for a listener that routes connections before they prove the key.

A connection is *pre-authenticated* from its first byte until the first frame it sends verifies. In
that phase a peer without the salt can make us hold bytes but nothing else, so every byte it sends is
counted twice: against its own small allowance (`PREAUTH_CONNECTION_BYTES`, which fits a legitimate
handshake and first frame) and against one global budget shared by every pre-authenticated
connection (`PreAuthBudget`). Going over either ends the connection before the bytes are buffered.
The count is of bytes received, an upper bound of what is held (the stream buffer and the frame
buffer together never hold more than was received).

`GatedReader` is the asyncio StreamReader the controller's mux hands to a channel handler. It also
remembers the channel the mux routed it to, so `accept_channel` can bind the session key to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Final, SupportsIndex

from flodld.wire.frames import HEADER_BYTES, NONCE_BYTES, PREAUTH_MAX_PAYLOAD, PREAUTH_MAX_TAIL, TAG_BYTES
from flodld.wire.magic import Channel

# A dialer sends its nonce and one first frame before anything verifies: that, plus a little slack.
PREAUTH_CONNECTION_BYTES: Final = (
    NONCE_BYTES + HEADER_BYTES + PREAUTH_MAX_PAYLOAD + PREAUTH_MAX_TAIL + TAG_BYTES + 1024
)
PREAUTH_BUDGET_BYTES: Final = 32 * 1024 * 1024


class PreAuthBudget:
    """Bytes held by connections that have not authenticated yet, across all of them."""

    def __init__(self, limit: int = PREAUTH_BUDGET_BYTES) -> None:
        if limit < 0:
            raise ValueError(f"a pre-authentication budget is >= 0 bytes, got {limit}")
        self.limit = limit
        self.used = 0

    def take(self, count: int) -> bool:
        """Reserve `count` bytes; False (nothing reserved) when that would exceed the budget."""
        if self.used + count > self.limit:
            return False
        self.used += count
        return True

    def give(self, count: int) -> None:
        self.used = max(0, self.used - count)


def charge(
    budget: PreAuthBudget, held: int, size: int, allowance: int = PREAUTH_CONNECTION_BYTES
) -> tuple[str, str] | None:
    """Count `size` more bytes of a pre-authenticated connection that holds `held`: None when they fit its
    `allowance` and the global `budget` (taken from it), else the refusal `(code, detail)` with nothing taken.
    """
    if held + size > allowance:
        return (
            "preauth_overrun",
            f"sent {held + size} bytes before its first frame verified (allowance {allowance})",
        )
    if not budget.take(size):
        return "preauth_budget", f"the global pre-authentication budget of {budget.limit} bytes is spent"
    return None


class GatedReader(asyncio.StreamReader):
    """A StreamReader that counts what an unauthenticated peer sends, and refuses past the allowance.

    `overrun(code, detail)` is called (once) instead of buffering bytes past the connection's allowance or
    the global budget; the owner aborts the transport there. `settle()` ends the accounting: call it
    when the first frame verifies (`accept_channel` wires that up) and when the connection ends.
    """

    def __init__(
        self,
        channel: Channel,
        budget: PreAuthBudget,
        *,
        limit: int,
        loop: asyncio.AbstractEventLoop,
        overrun: Callable[[str, str], None],
        on_authenticated: Callable[[], None] | None = None,
        allowance: int = PREAUTH_CONNECTION_BYTES,
    ) -> None:
        super().__init__(limit=limit, loop=loop)
        self.channel = channel
        self._budget = budget
        self._overrun = overrun
        self._on_authenticated = on_authenticated
        self._allowance = allowance
        self._held = 0
        self._settled = False
        self._refused = False

    @property
    def refused(self) -> bool:
        """True once this connection went over its allowance or the budget; its owner drops and counts it."""
        return self._refused

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def held(self) -> int:
        """Bytes counted against the budget for this connection (0 once settled)."""
        return self._held

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if self._refused:
            return
        size = (
            data.nbytes
            if isinstance(data, memoryview)
            else len(data if isinstance(data, bytes | bytearray) else bytes(data))
        )
        if not self._settled and size:
            refusal = charge(self._budget, self._held, size, self._allowance)
            if refusal is not None:
                self._refused = True
                self._overrun(*refusal)
                return
            self._held += size
        super().feed_data(data)

    def authenticated(self) -> None:
        """The first frame verified: stop counting, and tell the owner (it frees the address's gate slot)."""
        if not self._settled:
            self.settle()
            if self._on_authenticated is not None:
                self._on_authenticated()

    def settle(self) -> None:
        """Return this connection's bytes to the budget and stop counting (idempotent)."""
        if not self._settled:
            self._settled = True
            self._budget.give(self._held)
            self._held = 0
