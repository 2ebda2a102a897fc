"""A stalled log reader (full stderr pipe, stuck journald) must not stall the controller's port."""

from __future__ import annotations

import asyncio

import pytest

from .agents import http
from .daemon_proc import start_daemon

pytestmark = pytest.mark.multiproc

PIPE_BYTES = 64 * 1024  # Linux's default pipe buffer


async def _dropped_connection(port: int) -> None:
    """One connection with an unknown channel magic: the daemon logs a connection_dropped line for it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\xde\xad\xbe\xef" + b"x" * 400)
    await writer.drain()
    await reader.read()
    writer.close()


async def test_state_json_answers_while_nobody_reads_the_daemon_log() -> None:
    daemon = await start_daemon("--ranks", "4", "--window", "60")
    try:
        # Stop reading stderr and make the daemon log well past what the pipe holds.
        for _ in range(3 * PIPE_BYTES // 100 // 50):
            await asyncio.wait_for(asyncio.gather(*(_dropped_connection(daemon.port) for _ in range(50))), 10)
        status, body = await asyncio.wait_for(http(daemon.port, "GET", "/state.json"), 10)
        assert status == 200 and body["phase"] == "waiting"
        assert daemon.proc.returncode is None
    finally:
        daemon.kill()
        await asyncio.wait_for(daemon.proc.communicate(), 10)  # read the backlog, or the pipe never sees EOF


def test_the_log_queue_is_bounded_and_reports_what_it_dropped() -> None:
    import logging
    import queue

    from flodld.controller.logsetup import BoundedQueueHandler

    records: queue.Queue[logging.LogRecord] = queue.Queue(maxsize=4)
    handler = BoundedQueueHandler(records)
    logger = logging.getLogger("flodld.test.bounded")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for index in range(10):  # nobody drains: 4 fit, 6 are dropped, nothing blocks
            logger.warning("flood %d", index)
        assert records.qsize() == 4 and handler.dropped == 6 == handler.dropped_total
        while not records.empty():
            records.get_nowait()
        logger.warning("after the flood")
        notice, record = records.get_nowait(), records.get_nowait()
        assert (
            notice.getMessage() == "event=log_records_dropped count=6 reason='log writer behind; queue full'"
        )
        assert notice.levelno == logging.WARNING
        assert record.getMessage() == "after the flood" and handler.dropped == 0
    finally:
        logger.removeHandler(handler)
