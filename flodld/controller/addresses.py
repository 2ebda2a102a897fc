"""Private-address classification and the once-per-peer cleartext warning.

flodld's own frames are encrypted (wire protocol v2, AEAD), but a peer outside private address
space usually means the torch process group's traffic between ranks (gloo/NCCL, not flodld's)
crosses a link anyone on the path can read. We warn, never refuse: the operator may know the path
is safe (an overlay we cannot see), conventions warn.
"""

from __future__ import annotations

import ipaddress
import logging

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_ULA = ipaddress.IPv6Network("fc00::/7")

log = logging.getLogger("flodld.controller")


def is_private_address(address: str) -> bool:
    """True for loopback, RFC1918, link-local, CGNAT 100.64/10, IPv6 loopback/link-local/ULA.

    IPv4-mapped IPv6 addresses are judged by their IPv4 part; anything unparsable is public.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        else:
            return ip.is_loopback or ip.is_link_local or ip in _ULA
    if ip.is_loopback or ip.is_link_local or ip in _CGNAT:
        return True
    return any(ip in net for net in _RFC1918)


_RFC1918 = (
    ipaddress.IPv4Network("10.0.0.0/8"),
    ipaddress.IPv4Network("172.16.0.0/12"),
    ipaddress.IPv4Network("192.168.0.0/16"),
)


def is_loopback_address(address: str) -> bool:
    """True for 127/8, ::1 and IPv4-mapped loopback."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


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
            "CLEARTEXT; route it through an SSH tunnel (`tunnel: true`) or an encrypted overlay (WireGuard/VPN)",
            self._what,
            address,
        )
        return True
