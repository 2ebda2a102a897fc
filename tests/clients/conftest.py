"""Fixtures of the client tests."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def recorder() -> Iterator[tuple[int, list[tuple[str, dict[str, str]]]]]:
    """A loopback HTTP server that answers every POST as `/start` does; (its port, (path, headers) seen)."""
    seen: list[tuple[str, dict[str, str]]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, dict(self.headers.items())))
            body = b'{"armed": true, "joined_ranks": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1]), seen
    finally:
        server.shutdown()
        server.server_close()
