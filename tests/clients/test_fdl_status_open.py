"""`fdl status --open`: prints the status page's URL, opens a browser only with a display, never blocks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from fdl.status import page_url

from tests.clients.fdl_proc import NO_FDL_ENV, fdl
from tests.flodld.controller.daemon_proc import start_daemon

pytestmark = pytest.mark.multiproc


NO_DISPLAY = ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER", *NO_FDL_ENV)


def test_page_url_brackets_ipv6() -> None:
    assert page_url("127.0.0.1:1337") == "http://127.0.0.1:1337/status"
    assert page_url("[::1]:1337") == "http://[::1]:1337/status"


async def test_open_prints_the_url_and_hands_it_to_a_browser_only_with_a_display(tmp_path: Path) -> None:
    daemon = await start_daemon("--ranks", "1", "--window", "30", "--start", "manual")
    addr = f"127.0.0.1:{daemon.port}"
    # A browser command that records its argument and then stays up, as a browser that only returns
    # when closed would ($BROWSER runs in the foreground under `webbrowser`).
    opened, pid_file = tmp_path / "opened", tmp_path / "browser.pid"
    browser = tmp_path / "browser.sh"
    browser.write_text(
        f'#!/bin/sh\necho $$ > {pid_file}\necho "$1" > {opened}\nexec sleep 60 >/dev/null 2>&1\n'
    )
    browser.chmod(0o755)
    try:
        browser_env = {"BROWSER": str(browser)}
        code, out, err = await fdl("status", "--open", "--addr", addr, env=browser_env, drop=NO_DISPLAY)
        assert (code, out) == (0, f"http://{addr}/status\n")
        assert "no display here" in err and not opened.exists()  # no display: nothing is started

        started = time.monotonic()
        code, out, err = await fdl(
            "status", "--open", "--addr", addr, env={**browser_env, "DISPLAY": ":97"}, drop=NO_DISPLAY
        )
        took = time.monotonic() - started
        assert (code, out) == (0, f"http://{addr}/status\n"), err
        assert (
            took < 15
        )  # returned while the browser command is still running (it sleeps 60 s, output detached)
        assert opened.read_text().strip() == f"http://{addr}/status"
        assert os.path.exists(f"/proc/{pid_file.read_text().strip()}")

        code, out, err = await fdl("status", "--open", "--addr", "127.0.0.1:1", drop=NO_DISPLAY)
        assert code == 1 and out == "" and "no run listening" in err
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.kill()
        await daemon.proc.wait()
