"""`flodld serve` as the operator runs it: SIGTERM aborts the run cleanly, and the token stays secret."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flodld.net.stream import open_channel
from flodld.wire.join import Abort, Accept
from flodld.wire.magic import Channel
from flodld.wire.salt import salt_from_hex

from .daemon import hello, state
from .process import DaemonProcess

pytestmark = pytest.mark.multiproc

SIGTERM_BOUND_SECS = 5.0


async def test_sigterm_sends_abort_to_every_host_and_exits_143_without_a_traceback(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path)
    try:
        stream = await open_channel("127.0.0.1", daemon.port, Channel.JOIN, salt_from_hex(daemon.token), timeout=5)
        await stream.send(hello("member"))
        assert isinstance((await stream.recv(5)).message(), Accept)
        body = await state(daemon.port)
        daemon.proc.terminate()
        abort = (await stream.recv(SIGTERM_BOUND_SECS)).message()
        assert isinstance(abort, Abort) and "SIGTERM" in abort.reason
        code = await asyncio.get_running_loop().run_in_executor(None, daemon.proc.wait, SIGTERM_BOUND_SECS)
        daemon.kill()  # joins the stderr reader
        assert code == 128 + 15
        assert "Traceback" not in daemon.log and "never retrieved" not in daemon.log, daemon.log[-2000:]
        assert "event=run_failed" in daemon.log
        for text in (daemon.log, str(body), " ".join(daemon.argv)):
            assert daemon.token not in text.lower()
    finally:
        daemon.kill()
