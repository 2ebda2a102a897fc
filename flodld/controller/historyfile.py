"""`flodld serve --state-dir`: the run history on disk, so it survives a restart (the format and its
bounds are flodld/membership/history.py).

The state directory is `--state-dir`, else `$STATE_DIRECTORY` (systemd sets it from the unit's
`StateDirectory=`). In it:

- `history.jsonl` — the history, rewritten whole after each run: written to `history.jsonl.tmp` in the
  same directory, fsynced, renamed over the old file, and the directory fsynced, so a crash (kill -9,
  power loss) leaves the old file or the new one, never a mix. Mode 0600; the directory is created 0700.
- `history.jsonl.damaged` — the last damaged file read at start (its intact records were kept).
- `flodld.lock` — held (flock) while a daemon uses the directory: a second `flodld serve` on the same
  state directory is refused at start instead of overwriting the first one's history.

The calls here block (disk): the Service runs them in the default executor, off the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from flodld.membership.history import (
    MAX_HISTORY_BYTES,
    HistoryLoad,
    decode_history,
    encode_history,
)
from flodld.membership.snapshot import RunRecord

log = logging.getLogger("flodld.controller")

HISTORY_NAME = "history.jsonl"
TEMP_NAME = HISTORY_NAME + ".tmp"
DAMAGED_NAME = HISTORY_NAME + ".damaged"
LOCK_NAME = "flodld.lock"


class StateDirError(Exception):
    """The state directory cannot be used (cannot be created, or another daemon holds it)."""


def state_dir_from(flag: Path | None, environ: Mapping[str, str]) -> Path | None:
    """--state-dir, else the first directory of systemd's `$STATE_DIRECTORY`, else None (no file)."""
    if flag is not None:
        return flag
    given = environ.get("STATE_DIRECTORY", "")
    first = given.split(":")[0].strip()
    return Path(first) if first else None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HistoryFile:
    """The history file of one state directory; `open()` takes the directory's lock."""

    def __init__(self, directory: Path, *, max_bytes: int = MAX_HISTORY_BYTES) -> None:
        self.directory = directory
        self.path = directory / HISTORY_NAME
        self.max_bytes = max_bytes
        self._lock_fd: int | None = None

    def open(self) -> None:
        """Create the directory (0700) if missing, lock it, and remove a temp file a crash left behind."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise StateDirError(
                f"cannot use the state directory {self.directory}: {error.strerror or error}; pass "
                "--state-dir DIR naming a directory this user can create and write"
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            raise StateDirError(
                f"the state directory {self.directory} is in use by another flodld serve (it holds "
                f"{self.directory / LOCK_NAME}); give each daemon its own --state-dir"
            ) from error
        self._lock_fd = fd
        leftover = self.directory / TEMP_NAME
        if leftover.exists():
            leftover.unlink()
            log.warning(
                "event=history_temp_removed file=%s detail='a write the last daemon did not finish; "
                "the history file before it is intact'",
                leftover,
            )

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def load(self, limit_runs: int) -> HistoryLoad:
        """The records on disk (HistoryVersionError for a newer file). A damaged file is kept as
        `history.jsonl.damaged` and replaced at once by its intact records; the warning is logged.
        """
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(self.max_bytes + 1)  # capped before it is read into memory
        except FileNotFoundError:
            return HistoryLoad()
        oversize = len(data) > self.max_bytes
        load = decode_history(data[: self.max_bytes], source=str(self.path), limit_runs=limit_runs)
        if oversize:
            load.damaged.append(
                f"the file is over {self.max_bytes} bytes (not written by flodld): read its first "
                f"{self.max_bytes} bytes"
            )
        warning = load.warning(str(self.path))
        if warning is not None:
            damaged = self.directory / DAMAGED_NAME
            os.replace(self.path, damaged)
            self.save(load.records, limit_runs)
            log.warning("event=history_damaged %s; the damaged file is kept as %s", warning, damaged)
        return load

    def save(self, records: Sequence[RunRecord], limit_runs: int) -> int:
        """Replace the file with RECORDS (newest first, bounded); the bytes written."""
        data = encode_history(records, limit_runs=limit_runs, limit_bytes=self.max_bytes)
        temp = self.directory / TEMP_NAME
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        os.close(fd)
        os.replace(temp, self.path)
        _fsync_dir(self.directory)
        return len(data)
