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


@pytest.mark.parametrize(("extra", "expected"), [((), 0), (("--once",), 128 + 15)], ids=["service", "once"])
async def test_sigterm_sends_abort_to_every_host_and_exits_cleanly_without_a_traceback(
    tmp_path: Path, extra: tuple[str, ...], expected: int
) -> None:
    """The service stops cleanly (exit 0: `systemctl stop` leaves the unit inactive, not failed), the
    aborted run's reason in the log; `--once` keeps 128+N.
    """
    daemon = DaemonProcess(tmp_path, extra=extra)
    try:
        stream = await open_channel(
            "127.0.0.1", daemon.port, Channel.JOIN, salt_from_hex(daemon.token), timeout=5
        )
        await stream.send(hello("member"))
        assert isinstance((await stream.recv(5)).message(), Accept)
        body = await state(daemon.port)
        daemon.proc.terminate()
        abort = (await stream.recv(SIGTERM_BOUND_SECS)).message()
        assert isinstance(abort, Abort) and "SIGTERM" in abort.reason
        code = await asyncio.get_running_loop().run_in_executor(None, daemon.proc.wait, SIGTERM_BOUND_SECS)
        daemon.kill()  # joins the stderr reader
        assert code == expected
        assert "Traceback" not in daemon.log and "never retrieved" not in daemon.log, daemon.log[-2000:]
        assert "event=run_failed" in daemon.log
        if not extra:
            assert "event=run_ended" in daemon.log and "controller received SIGTERM" in daemon.log
        for text in (daemon.log, str(body), " ".join(daemon.argv)):
            assert daemon.token not in text.lower()
    finally:
        daemon.kill()
