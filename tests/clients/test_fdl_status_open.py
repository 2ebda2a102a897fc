"""`fdl status --open`: prints the status page's URL, opens a browser only with a display, never blocks."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from fdl.status import page_url

from tests.flodld.controller.daemon_proc import start_daemon

pytestmark = pytest.mark.multiproc


async def _fdl(*args: str, env: dict[str, str]) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fdl.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - started


def _env(**extra: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER", "FDL_ENV")
    }
    return {**base, **extra}


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
        code, out, err, _ = await _fdl("status", "--open", "--addr", addr, env=_env(BROWSER=str(browser)))
        assert (code, out) == (0, f"http://{addr}/status\n")
        assert "no display here" in err and not opened.exists()  # no display: nothing is started

        code, out, err, took = await _fdl(
            "status", "--open", "--addr", addr, env=_env(BROWSER=str(browser), DISPLAY=":97")
        )
        assert (code, out) == (0, f"http://{addr}/status\n"), err
        assert (
            took < 15
        )  # returned while the browser command is still running (it sleeps 60 s, output detached)
        assert opened.read_text().strip() == f"http://{addr}/status"
        assert os.path.exists(f"/proc/{pid_file.read_text().strip()}")

        code, out, err, _ = await _fdl("status", "--open", "--addr", "127.0.0.1:1", env=_env())
        assert code == 1 and out == "" and "no run listening" in err
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.kill()
        await daemon.proc.wait()
