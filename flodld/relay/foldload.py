"""The fold's import (torch, the barrier, torch's first meta op) in a worker thread, once per shell.

Two shells fold rounds on an event loop that also carries every rank's heartbeat: a host's relay and the
controller's data plane. Both start the load early (the relay as it starts, the data plane as its world
forms) and await it before their first fold; the import takes seconds on a loaded host, and on the loop it
would stall the heartbeats past a short liveness timeout. Off the loop it still holds the interpreter lock
through long stretches (~140 ms in one piece on an idle machine), which is why it starts before the first
deposit, not at it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from flodld.fold import fold_loaded, load_fold

log = logging.getLogger("flodld.fold.load")


class FoldLoad:
    """One shell's load of the fold: `start` begins it (once), `ready` awaits it (starting it if need be).

    A load that failed is started again by the next `ready`, whose caller's round fails with the error (an
    import failure is logged `event=fold_load_failed`, a warning, either way). `loaded_level`: the level of
    the `event=fold_loaded secs=…` line; the controller's log keeps it (INFO), a relay's output, which
    reaches the operator's terminal through its agent, does not (DEBUG).
    """

    def __init__(self, *, loaded_level: int = logging.DEBUG) -> None:
        self._loading: asyncio.Future[None] | None = None
        self._loaded_level = loaded_level

    def start(self) -> None:
        """Begin loading in a worker thread, unless loaded or loading (call inside the event loop).

        The thread is the loop's executor's, not a daemon thread of its own: an interpreter that finalizes
        in the middle of torch's import in a daemon thread aborts (SIGABRT). The price: asyncio.run joins
        the executor at the loop's end, so a shell stopped while torch loads waits for the import.
        """
        if fold_loaded() or (self._loading is not None and not self._loading.done()):
            return
        started = time.monotonic()
        self._loading = asyncio.ensure_future(asyncio.to_thread(load_fold))

        def loaded(done: asyncio.Future[None]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                log.warning("event=fold_load_failed error=%r", str(error))
            else:
                log.log(self._loaded_level, "event=fold_loaded secs=%.2f", time.monotonic() - started)

        self._loading.add_done_callback(loaded)

    async def ready(self) -> None:
        """Return once the fold is loaded; raises the load's error if it failed."""
        if fold_loaded():
            return
        self.start()
        assert self._loading is not None
        await asyncio.shield(self._loading)
