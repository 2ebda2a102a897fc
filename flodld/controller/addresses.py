"""The once-per-peer cleartext warning (address classification itself: `flodld.net.addresses`).

flodld's own frames are encrypted (wire protocol v2, AEAD), but a peer outside private address
space usually means the torch process group's traffic between ranks (gloo/NCCL, not flodld's)
crosses a link anyone on the path can read. We warn, never refuse: the operator may know the path
is safe (an overlay we cannot see), conventions warn.
"""

from __future__ import annotations

import logging

from flodld.net.addresses import is_loopback_address, is_private_address

__all__ = ["MAX_WARNED_ADDRESSES", "CleartextWarner", "is_loopback_address", "is_private_address"]

log = logging.getLogger("flodld.controller")

# How many public addresses a warner remembers: a flood of distinct sources costs at most this many
# entries (the oldest is forgotten first, and warned about again if it comes back).
MAX_WARNED_ADDRESSES = 1024


class CleartextWarner:
    """Logs one loud warning per distinct public peer address, remembering at most `limit` addresses."""

    def __init__(
        self,
        what: str = "controller",
        logger: logging.Logger | None = None,
        *,
        limit: int = MAX_WARNED_ADDRESSES,
    ) -> None:
        if limit < 1:
            raise ValueError(f"a cleartext warner remembers at least 1 address, got {limit}")
        self._what = what
        self._log = logger or log
        self._limit = limit
        self._warned: dict[str, None] = {}  # insertion-ordered: the first key is the oldest

    def __len__(self) -> int:
        return len(self._warned)

    def check(self, address: str) -> bool:
        """Warn if `address` is public and not warned about yet; return whether a warning was logged."""
        if is_private_address(address) or address in self._warned:
            return False
        if len(self._warned) >= self._limit:
            del self._warned[next(iter(self._warned))]
        self._warned[address] = None
        self._log.warning(
            "event=cleartext_peer what=%s peer=%s WARNING: peer is outside every private address range; "
            "flodld's frames to it are encrypted, but the process group's rank traffic (gloo/NCCL) is "
            "CLEARTEXT; route it through an SSH tunnel (`tunnel: true`) or an encrypted overlay "
            "(WireGuard/VPN)",
            self._what,
            address,
        )
        return True
