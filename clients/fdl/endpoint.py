"""A tiny blocking HTTP client for the controller port (stdlib only: the CLI must start fast)."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass

HTTP_TIMEOUT_SECS = 5.0


@dataclass(frozen=True)
class HttpReply:
    status: int
    reason: str
    body: bytes

    def json(self) -> object:
        """The body as JSON: whatever value it holds (narrow it before use)."""
        return json.loads(self.body)


def request(
    host: str,
    port: int,
    method: str,
    path: str,
    *,
    timeout: float = HTTP_TIMEOUT_SECS,
    bearer: str | None = None,
    headers: dict[str, str] | None = None,
) -> HttpReply:
    """One request on a fresh connection; OSError when nothing answers.

    A `bearer` credential travels in the Authorization header, never in the URL, so it stays
    out of proxy and access logs.
    """
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    sent = {**(headers or {}), "Connection": "close", "Content-Length": "0"}
    if bearer:
        sent["Authorization"] = f"Bearer {bearer}"
    try:
        connection.request(method, path, headers=sent)
        response = connection.getresponse()
        return HttpReply(response.status, response.reason, response.read())
    except http.client.HTTPException as error:
        raise OSError(f"bad HTTP answer: {error!r}") from error
    finally:
        connection.close()
