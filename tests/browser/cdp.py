"""A minimal Chrome DevTools Protocol driver: a headless system chromium, one page, over aiohttp's websocket.

Just enough to load a URL, evaluate JavaScript in the page (what a person would read, as text) and take
a screenshot. No driver package: the protocol is JSON over one websocket.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

_DEVTOOLS = re.compile(rb"DevTools listening on (ws://\S+)")


class CdpError(Exception):
    """The browser answered a command with an error, or the page threw."""


class Connection:
    """The browser's DevTools websocket: numbered commands, their replies, and the events we keep."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.console: list[str] = []  # console messages, exceptions and log entries of the page
        self.requests: list[tuple[str, str]] = []  # (method, url) of every request the page sent
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None:
                if not future.done():
                    future.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(data["params"]["exceptionDetails"])[:500])
            elif data.get("method") == "Network.requestWillBeSent":
                request = data["params"]["request"]
                self.requests.append((request["method"], request["url"]))
            elif data.get("method") == "Log.entryAdded":
                entry = data["params"]["entry"]
                self.console.append(f"{entry.get('level')}: {entry.get('text')} {entry.get('url', '')}")
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(CdpError("the browser closed the DevTools connection"))

    async def send(self, method: str, session: str | None = None, timeout: float = 10.0,
                   **params: object) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        await self.ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        return reply.get("result", {})  # type: ignore[no-any-return]

    def close(self) -> None:
        self._reader.cancel()


class Page:
    """One page target, attached through a flat session on the browser's connection."""

    def __init__(self, connection: Connection, session: str) -> None:
        self.connection = connection
        self.session = session

    @property
    def console(self) -> list[str]:
        return self.connection.console

    @property
    def requests(self) -> list[tuple[str, str]]:
        return self.connection.requests

    async def send(self, method: str, timeout: float = 10.0, **params: object) -> dict[str, Any]:
        return await self.connection.send(method, self.session, timeout, **params)

    async def evaluate(self, expression: str) -> Any:  # noqa: ANN401  the page's JSON value
        """The value of a JavaScript expression in the page (JSON-serializable results only)."""
        reply = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise CdpError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def text(self, selector: str) -> str | None:
        """What a person reads in the first element matching `selector` (None when there is none)."""
        return await self.evaluate(  # type: ignore[no-any-return]
            f"(function(){{var e=document.querySelector({json.dumps(selector)});"
            "return e?e.innerText:null;})()"
        )

    async def wait_for(self, expression: str, timeout: float = 10.0) -> Any:  # noqa: ANN401  the page's JSON
        """Poll until `expression` is truthy in the page; its value."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(
                    f"not true within {timeout}s in the page: {expression}\nconsole: {self.console}"
                )
            await asyncio.sleep(0.1)

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def screenshot(self, path: Path, width: int = 1100) -> None:
        """The whole page as a PNG, `width` CSS pixels wide."""
        height = await self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        reply = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(reply["data"]))


async def _browser_url(proc: asyncio.subprocess.Process, timeout: float) -> str:
    assert proc.stderr is not None
    seen = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - loop.time()))
        if not line:
            raise CdpError(
                f"chromium exited before DevTools listened: {seen.decode(errors='replace')[-2000:]}"
            )
        seen += line
        found = _DEVTOOLS.search(line)
        if found:
            return found.group(1).decode()


async def _drain(stream: asyncio.StreamReader | None) -> None:
    """Keep reading chromium's stderr so a full pipe never stalls it."""
    if stream is not None:
        while await stream.read(65536):
            pass


@asynccontextmanager
async def headless_page(chromium: str, profile: Path, *, javascript: bool = True) -> AsyncIterator[Page]:
    """A fresh headless chromium with its own profile dir, and one blank page attached to it."""
    args = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--mute-audio",
        "--hide-scrollbars",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={profile}",
        "--window-size=1100,900",
        "about:blank",
    ]
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    drain: asyncio.Task[None] | None = None
    try:
        url = await _browser_url(proc, 30)
        drain = asyncio.get_running_loop().create_task(_drain(proc.stderr))
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=64 * 1024 * 1024) as ws:
            connection = Connection(ws)
            try:
                target = await connection.send("Target.createTarget", url="about:blank")
                attached = await connection.send(
                    "Target.attachToTarget", targetId=target["targetId"], flatten=True
                )
                page = Page(connection, attached["sessionId"])
                for domain in ("Page", "Runtime", "Log", "Network"):
                    await page.send(f"{domain}.enable")
                if not javascript:
                    await page.send("Emulation.setScriptExecutionDisabled", value=True)
                yield page
            finally:
                connection.close()
    finally:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await proc.wait()
        if drain is not None:
            drain.cancel()
