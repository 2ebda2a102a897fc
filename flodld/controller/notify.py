"""systemd `Type=notify` support: send READY/STATUS/STOPPING datagrams to $NOTIFY_SOCKET.

Implemented on a plain AF_UNIX datagram socket so no systemd library is needed. A path starting
with '@' names the Linux abstract namespace (leading NUL byte). Without NOTIFY_SOCKET every call
is a no-op, so the daemon runs the same under a terminal.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("flodld.controller")


class SystemdNotifier:
    """Best-effort sd_notify: failures are logged at debug level, never raised (the run matters more)."""

    def __init__(self, socket_path: str | None = None) -> None:
        path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET")
        self._address: str | bytes | None = None
        if path:
            self._address = b"\0" + path[1:].encode() if path.startswith("@") else path

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send `KEY=value` lines as one datagram; return whether it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(self._address)
                sock.sendall(payload)
        except OSError as exc:
            log.debug("event=sd_notify_failed error=%s", exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> bool:
        """A SIGHUP reload began (READY=1 follows when it is done)."""
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={now_usec}", "STATUS=reloading the config")
