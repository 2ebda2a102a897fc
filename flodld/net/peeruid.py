"""Who is on the other end of a loopback TCP connection: the uid that owns the peer's socket (Linux).

TCP has no SO_PEERCRED (that is AF_UNIX's), but the kernel keeps both ends of a loopback connection
in /proc/net/tcp{,6} with the uid that owns each socket: the peer's socket is the entry whose local
address is the connection's remote end. The agent's TCPStore endpoint and the relay's rank listener
serve only connections from their own uid with it.
"""

from __future__ import annotations

import ipaddress
import os

_PROC_NET = ("/proc/net/tcp", "/proc/net/tcp6")


def peer_uid_known_here(tables: tuple[str, ...] = _PROC_NET) -> bool:
    """True when this platform lists TCP sockets with their owners (Linux /proc), so a peer's uid can be
    looked up; elsewhere a listener has only its loopback bind and its other bounds.
    """
    return any(os.path.exists(table) for table in tables)


def _parse_proc_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """'0100007F:1F90' (or the 32-hex-digit IPv6 form) as /proc/net/tcp prints it: words in host order."""
    host_hex, port_hex = text.split(":")
    raw = bytes.fromhex(host_hex)
    words = b"".join(raw[index : index + 4][::-1] for index in range(0, len(raw), 4))  # little-endian hosts
    address = ipaddress.ip_address(words)
    return address, int(port_hex, 16)


def _plain(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def socket_owner_uid(
    local: tuple[str, int], remote: tuple[str, int], *, tables: tuple[str, ...] = _PROC_NET
) -> int | None:
    """The uid owning the TCP socket bound to `local` and connected to `remote` on this host, or None.

    For a connection accepted on 127.0.0.1, pass the peer's address as `local` and ours as `remote`:
    the peer's socket is the entry with those ends (the kernel keeps both ends of a loopback connection).
    """
    want_local = (_plain(ipaddress.ip_address(local[0])), local[1])
    want_remote = (_plain(ipaddress.ip_address(remote[0])), remote[1])
    for table in tables:
        try:
            with open(table, encoding="ascii") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    try:
                        here, there = _parse_proc_address(fields[1]), _parse_proc_address(fields[2])
                    except ValueError:
                        continue
                    if (_plain(here[0]), here[1]) == want_local and (
                        _plain(there[0]),
                        there[1],
                    ) == want_remote:
                        return int(fields[7])
        except OSError:
            continue
    return None
