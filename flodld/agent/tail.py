"""What an agent tells the controller about a failed rank besides its exit code: the tail of its output and
the exception from its error file, bounded and scrubbed of the run's secrets (the root cause, see
flodld/membership/rootcause.py).

`OutputTail` is a small ring of the rank's last output lines, fed where the agent reads them (one line per
`feed`, separate from whatever else the agent does with the output). `Scrubber` replaces every secret the
agent knows (the run's salt, its host key, the join token, values of secret-looking environment variables)
with `<redacted>` before a line leaves the host. `read_error_file` reads what torch's
`@record` (torch.distributed.elastic.multiprocessing.errors) writes to `TORCHELASTIC_ERROR_FILE`.
"""

from __future__ import annotations

import json
import os
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from flodld.wire.messages import MAX_REASON_CHARS, MAX_TAIL_CHARS, MAX_TAIL_LINES

REDACTED = "<redacted>"
MIN_SECRET_CHARS = 8  # shorter values (ports, flags) are not scrubbed: they would blank ordinary words
MAX_LINE_CHARS = 2 * MAX_TAIL_CHARS  # a longer line keeps its end (scrubbed first)
MAX_ERROR_FILE_BYTES = 256 * 1024
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_SECRET_NAME = re.compile(r"(?i)(TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|API_?KEY|PRIVATE_?KEY|SALT)")


class Scrubber:
    """Replaces each known secret (as given, and hex ones in either case) with `<redacted>`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        found: set[str] = set()
        for secret in secrets:
            if secret and len(secret) >= MIN_SECRET_CHARS:
                found.update({secret, secret.lower(), secret.upper()})
        # Longest first: a secret that contains another is replaced whole.
        self._secrets = sorted(found, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    @staticmethod
    def secrets_in_env(env: Mapping[str, str]) -> list[str]:
        """Values of variables whose name says they are secret (…TOKEN, …SECRET, …PASSWORD, …KEY, …SALT)."""
        return [value for name, value in env.items() if _SECRET_NAME.search(name) and value]


TRACEBACK_MARK = "Traceback (most recent call last):"
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch's excepthook prefixes a rank's traceback lines


class OutputTail:
    """The last `MAX_TAIL_LINES` lines of a child's output, and when its last traceback began."""

    def __init__(self, scrub: Scrubber | None = None, lines: int = MAX_TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._scrub = scrub or Scrubber()
        self._fed = 0
        self._traceback: tuple[int, float] | None = None  # (line number, when it was read)

    def feed(self, line: bytes, now: float | None = None) -> None:
        """One line of output, read at `now` (unix seconds; None: not timed)."""
        text = line.decode(errors="replace").rstrip("\r\n")
        if len(text) > MAX_LINE_CHARS:  # scrubbed before the cut, so no half secret survives it
            text = "…" + self._scrub(text)[-MAX_LINE_CHARS:]
        self._fed += 1
        if now is not None and TRACEBACK_MARK in text:
            self._traceback = (self._fed, now)
        self._lines.append(text)

    @property
    def traceback_at(self) -> float | None:
        """When the last Python traceback in the tail began to print (None: none there).

        An uncaught exception prints its traceback before the interpreter shuts down (and before torch
        closes the process group's connections, which is what makes the peers fail): the rank failed then,
        not when its process was finally gone.
        """
        if self._traceback is None or self._traceback[0] <= self._fed - (self._lines.maxlen or 0):
            return None
        return self._traceback[1]

    def exception_line(self) -> str | None:
        """The last line of the last traceback in the tail ('RuntimeError: boom', without torch's '[rank1]: '
        prefix), scrubbed: the exception of a rank that left no error file. None without a traceback.
        """
        if self.traceback_at is None:
            return None
        lines = list(self._lines)
        start = max(index for index, line in enumerate(lines) if TRACEBACK_MARK in line)
        block = [_RANK_PREFIX.sub("", line).strip() for line in lines[start + 1 :]]
        # The traceback's frames are indented ('  File ...'); the exception is the first unindented line.
        candidates = [
            line for raw, line in zip(lines[start + 1 :], block, strict=True)
            if line and not _RANK_PREFIX.sub("", raw).startswith((" ", "\t"))
        ]  # fmt: skip
        if not candidates:
            return None
        return self._scrub(candidates[0])[:MAX_REASON_CHARS]

    def render(self) -> str | None:
        """The tail as one text (fits `RankExited.tail`), scrubbed; None when the child printed nothing."""
        if not self._lines:
            return None
        text = self._scrub("\n".join(self._lines))
        if len(text) > MAX_TAIL_CHARS:
            text = text[-MAX_TAIL_CHARS:]
            cut = text.find("\n")
            text = text[cut + 1 :] if 0 <= cut < len(text) - 1 else text
        lines = text.split("\n")[-MAX_TAIL_LINES:]  # a scrubbed secret never adds lines; kept safe anyway
        return "\n".join(lines)


@dataclass(frozen=True)
class ErrorFile:
    """What `@record` left: the exception's line and when the file was written (unix seconds)."""

    message: str
    written_at: float


def read_error_file(path: Path | None, scrub: Scrubber | None = None) -> ErrorFile | None:
    """The exception `@record` wrote ('RuntimeError: boom'), scrubbed and capped; None without one."""
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            written_at = os.fstat(handle.fileno()).st_mtime
            raw = handle.read(MAX_ERROR_FILE_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_ERROR_FILE_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    message: object = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    return ErrorFile((scrub or Scrubber())(message.strip())[:MAX_REASON_CHARS], written_at)


def failure_time(exited_at: float, *evidence: float | None) -> float:
    """When the rank failed: the earliest sign of its exception (the error file's write, its traceback's
    first line) that is not after its exit, else the exit itself.
    """
    return min([exited_at, *(at for at in evidence if at is not None and at <= exited_at)])
