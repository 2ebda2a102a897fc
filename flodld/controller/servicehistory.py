"""The service's run history: finished runs newest first, kept in memory and, with a state directory, in its
history file (flodld/controller/historyfile.py), read and written off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from flodld.controller.historyfile import HistoryFile
from flodld.membership.history import HistoryVersionError
from flodld.membership.snapshot import RunRecord

log = logging.getLogger("flodld.controller")


class ServiceHistory:
    """Up to `limit` finished runs (`records`, newest first) and their file; `on_change` when state.json's
    history part changes (a write that failed or recovered).
    """

    def __init__(self, file: HistoryFile | None, limit: int, *, on_change: Callable[[], None]) -> None:
        self.records: deque[RunRecord] = deque(maxlen=limit)
        self.file = file  # None: the history lives in memory only (no state directory)
        self.error: str | None = None
        self._writable = file is not None
        self._on_change = on_change
        self._save_pending = False
        self._saver: asyncio.Task[None] | None = None

    async def flush(self) -> None:
        """Until the write in flight (if any) is done."""
        if self._saver is not None:
            await self._saver

    def resize(self, limit: int) -> None:
        """Keep up to `limit` runs from now on (a reload changed `history_runs`)."""
        if self.records.maxlen != limit:
            self.records = deque(self.records, maxlen=limit)

    async def load(self) -> None:
        """The runs an earlier daemon recorded in the state directory, read off the event loop."""
        file = self.file
        if file is None:
            return
        limit = self.records.maxlen or 1
        try:
            load = await asyncio.get_running_loop().run_in_executor(None, file.load, limit)
        except HistoryVersionError as error:
            self._writable = False  # a newer flodld's file is never overwritten
            self.error = str(error)
            log.error("event=history_refused file=%s reason=%r", file.path, self.error)
            return
        except (OSError, ValueError) as error:  # unreadable: start empty, and say so
            self.error = f"cannot read history file {file.path}: {error}"
            log.error("event=history_unreadable file=%s error=%r", file.path, str(error))
            return
        self.records.extend(load.records)  # newest first, as the deque keeps them
        self.error = load.warning(str(file.path))
        log.info(
            "event=history_loaded file=%s runs=%d skipped=%d", file.path, len(load.records), load.skipped
        )

    def save(self) -> None:
        """Write the history to the state directory (one write in flight; the latest history wins)."""
        if not self._writable:
            return
        self._save_pending = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.get_running_loop().create_task(self._save_loop())

    async def _save_loop(self) -> None:
        file = self.file
        assert file is not None
        loop = asyncio.get_running_loop()
        while self._save_pending:
            self._save_pending = False
            records = list(self.records)
            before = self.error
            try:
                size = await loop.run_in_executor(None, file.save, records, self.records.maxlen or 1)
            except OSError as error:  # disk full, read-only: the daemon goes on, the history in memory
                self.error = f"cannot write history file {file.path}: {error}"
                log.error("event=history_write_failed file=%s error=%r", file.path, str(error))
            else:
                if self.error is not None and self.error.startswith("cannot write"):
                    self.error = None
                log.debug("event=history_saved file=%s runs=%d bytes=%d", file.path, len(records), size)
            if self.error != before:
                self._on_change()
