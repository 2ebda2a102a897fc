"""What the HTTP surface asks of the controller (`StatusSource`) and a decided answer (`HttpAnswer`).

Its own module so that the app (`http.py`) and the page (`page.py`) both depend on it, not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: dict[str, Any]


class StatusSource(Protocol):
    """What the HTTP app asks the controller."""

    def state_json(self) -> dict[str, Any] | None:
        """The snapshot as JSON-ready data, or None before the window has state (shared: do not change it).

        A source may also offer `state_body(members, source) -> bytes | None`: the same as JSON text, for the
        member page `members` (flodld.controller.status.snapshot.MemberRange), encoded once for every reader,
        work past its cache charged to the reader's address `source` (`RenderRefused` past the render budget);
        and `status_html(source) -> bytes`, the status page rendered once per build.
        """

    def metrics_text(self) -> str:
        """Prometheus text exposition."""

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        """Decide a POST /start from a local caller (`local`: loopback, not a browser, START_HEADER sent and
        no credential presented) or any other caller presenting `token` (the start credential), which is
        checked whoever presents it.
        """
