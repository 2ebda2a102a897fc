"""Address classification, pure and light: what the controller, the agent and the relay judge peers by.

Private space is where the torch process group's cleartext rank traffic (gloo/NCCL, not flodld's
encrypted frames) may go unwarned; `flodld.controller.addresses.CleartextWarner` warns about the rest.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback_address", "is_private_address"]

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_ULA = ipaddress.IPv6Network("fc00::/7")


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
