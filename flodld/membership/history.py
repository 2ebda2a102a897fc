"""The `flodld serve` run history as a file: its format, parsing and bounds (sans-io).

The file is JSON lines. Line 1 is the header `{"format": "flodld-history", "version": 1}`; each further
line is one `RunRecord` (the same fields as a `state.json` `history` entry), newest first. One record per
line is what lets a damaged file still give back its intact records: a line that is not JSON, or not a
valid record, is skipped and named, and the rest load. A file from a newer flodld (a higher `version`) is
refused as a whole (`HistoryVersionError`): its records may mean something this flodld cannot read.

Records go through `RunRecord.model_dump`/`model_validate`, so a field added to `RunRecord` is written
and read back with no change here (give it a default, so records written before it still load; a field
this flodld does not know, written by a newer one of the same format version, is left out on reading).

One record per *run*, not per attempt: with restarts (`--max-restarts`), an attempt that follows a failed
one takes that one's place (`record_run`), so the run's entry is its latest attempt, whose `attempt.earlier`
names every attempt before it (number, run id, cause, hosts).

The shell (flodld/controller/historyfile.py) reads and writes the bytes; nothing here does I/O.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from flodld.membership.snapshot import RunRecord

HISTORY_FORMAT = "flodld-history"
HISTORY_VERSION = 1
"""The version this flodld writes and the highest it reads."""

MAX_HISTORY_BYTES = 4 << 20
"""The history file never grows past this (header included): the oldest runs are left out first."""

MAX_NAMED_DAMAGE = 5
"""Damaged lines named one by one in a warning; the rest are counted."""


class HistoryVersionError(ValueError):
    """The file was written by a newer flodld; its message names the file, both versions and the fix."""


@dataclass(frozen=True)
class HistoryLoad:
    """What a history file gave back: its records (newest first) and the lines that were skipped."""

    records: list[RunRecord] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    """One entry per skipped line: `line N: why`."""

    @property
    def skipped(self) -> int:
        return len(self.damaged)

    def warning(self, source: str) -> str | None:
        """The operator's sentence about the skipped lines of SOURCE; None when nothing was skipped."""
        if not self.damaged:
            return None
        named = "; ".join(self.damaged[:MAX_NAMED_DAMAGE])
        more = f"; and {self.skipped - MAX_NAMED_DAMAGE} more" if self.skipped > MAX_NAMED_DAMAGE else ""
        return (
            f"history file {source} is damaged: skipped {self.skipped} unreadable "
            f"line{'s' if self.skipped != 1 else ''} ({named}{more}); kept the {len(self.records)} "
            f"intact run{'s' if len(self.records) != 1 else ''}"
        )


def continues(previous: RunRecord, record: RunRecord) -> bool:
    """Whether RECORD is the next attempt of the run PREVIOUS is the latest attempt of."""
    earlier = record.attempt.earlier if record.attempt is not None else []
    return bool(earlier) and earlier[-1].run_id == previous.run_id


def record_run(history: deque[RunRecord], record: RunRecord) -> None:
    """Put RECORD first in HISTORY (newest first): in place of its run's previous attempt, if that is the
    newest entry, else as a new run.
    """
    if history and continues(history[0], record):
        history[0] = record
    else:
        history.appendleft(record)


def header() -> bytes:
    """The first line of every history file this flodld writes."""
    return json.dumps({"format": HISTORY_FORMAT, "version": HISTORY_VERSION}).encode() + b"\n"


def encode_history(
    records: Iterable[RunRecord], *, limit_runs: int, limit_bytes: int = MAX_HISTORY_BYTES
) -> bytes:
    """The file for RECORDS (newest first): at most LIMIT_RUNS of them and LIMIT_BYTES in all.

    Past either bound the oldest records are left out; a record that alone would overflow the byte
    bound ends the file there (the newer ones before it are kept).
    """
    out = bytearray(header())
    for count, record in enumerate(records):
        if count >= limit_runs:
            break
        line = json.dumps(record.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))
        data = line.encode() + b"\n"
        if len(out) + len(data) > limit_bytes:
            break
        out += data
    return bytes(out)


def _header_version(line: bytes) -> int | None:
    """The version a header line names; None when the line is not a history header."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("format") != HISTORY_FORMAT:
        return None
    version = value.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return None
    return version


def _known_fields(value: object) -> object:
    """A record's fields this flodld's RunRecord has: those a newer flodld added are left out."""
    if isinstance(value, dict):
        return {key: item for key, item in value.items() if key in RunRecord.model_fields}
    return value


def _why(error: Exception, *, last: bool) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "record"
        return f"not a run record ({where}: {first.get('msg', 'invalid')})"
    return "cut off (truncated JSON)" if last else "not JSON"


def decode_history(data: bytes, *, source: str, limit_runs: int) -> HistoryLoad:
    """The records in DATA (a history file's bytes), at most LIMIT_RUNS, newest first.

    Damaged lines are skipped and named in `HistoryLoad.damaged`; a missing or unreadable header is
    itself a damaged line (the records after it are still read as this version's). A header naming a
    newer version raises `HistoryVersionError`.
    """
    load = HistoryLoad()
    if not data.strip():
        return load
    lines = data.split(b"\n")
    ends_cleanly = data.endswith(b"\n")
    if ends_cleanly:
        lines.pop()  # the empty piece after the last newline
    version = _header_version(lines[0])
    first_record = 1
    if version is None:
        load.damaged.append("line 1: not a flodld history header")
        first_record = 0 if lines[0].lstrip().startswith(b"{") else 1
    elif version > HISTORY_VERSION:
        raise HistoryVersionError(
            f"history file {source} was written by a newer flodld (history format {version}; this flodld "
            f"reads up to {HISTORY_VERSION}); it is left untouched and this daemon keeps no history in it — "
            "upgrade flodld, or move the file aside to start a new history"
        )
    for index in range(first_record, len(lines)):
        if len(load.records) >= limit_runs:
            break
        line = lines[index]
        if not line.strip():
            continue
        last = index == len(lines) - 1 and not ends_cleanly
        try:
            record = RunRecord.model_validate(_known_fields(json.loads(line)))
        except (ValueError, TypeError) as error:  # ValidationError is a ValueError
            if index == 0 and version is None:
                continue  # already named as the missing header
            load.damaged.append(f"line {index + 1}: {_why(error, last=last)}")
            continue
        load.records.append(record)
    return load
