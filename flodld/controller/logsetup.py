"""Structured, one-line-per-event logging that reads well on a terminal and in journald.

Messages are `event=name key=value ...`. Under journald (JOURNAL_STREAM set) lines carry a
`<N>` syslog priority prefix instead of a timestamp, which journald turns into the priority.

Records go through a queue to a writer thread: a slow reader of stderr (a full pipe, a stalled
journald) must never block the event loop, or one join storm's log lines would delay every other
connection on the port (state.json p99 went from ~1 s to milliseconds when this moved off the loop).
The queue is bounded: when the writer cannot keep up (a log flood from abusive peers, a stalled
journald), new records are dropped and counted instead of growing memory without limit, and
the count is logged as soon as a record fits again.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import queue
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

_listener: logging.handlers.QueueListener | None = None

# Records waiting for the writer thread; at ~1 KiB each this caps the backlog near 16 MiB.
LOG_QUEUE_RECORDS = 16384


class BoundedQueueHandler(logging.handlers.QueueHandler):
    """A QueueHandler that never blocks and never grows past its queue: overflow is counted."""

    def __init__(self, records: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(records)
        self.records = records
        self.dropped = 0
        self.dropped_total = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped:
                notice = logging.LogRecord(
                    "flodld.logging", logging.WARNING, __file__, 0,
                    "event=log_records_dropped count=%d reason='log writer behind; queue full'",
                    (self.dropped,), None,
                )  # fmt: skip
                self.records.put_nowait(notice)
                self.dropped = 0
            self.records.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            self.dropped_total += 1


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        return f"<{priority}>{record.name}: {super().format(record)}"


def configure_logging(verbose: bool = False) -> None:
    """Log to stderr through a writer thread; call `flush_logging()` before writing to stderr directly."""
    global _listener
    stop_logging()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    records: queue.Queue[logging.LogRecord] = queue.Queue(maxsize=LOG_QUEUE_RECORDS)
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [BoundedQueueHandler(records)]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        logging.getLogger("aiohttp").setLevel(logging.WARNING)
        logging.getLogger("asyncio").setLevel(logging.WARNING)


def flush_logging() -> None:
    """Write out every queued record (blocks until done), so later direct stderr writes come after them."""
    if _listener is not None:
        _listener.stop()
        _listener.start()


def stop_logging() -> None:
    """Write out what is queued and end the writer thread (idempotent; also runs at exit)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


atexit.register(stop_logging)
