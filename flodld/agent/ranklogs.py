"""Per-rank log files on the host that ran the rank (`--log-dir`, `--redirects`, `--tee`).

Layout, one directory per run, attempt, host and rank, under the host's own log directory:

    DIR/RUN/attempt_N/HOST/rank_R/stdout.log
    DIR/RUN/attempt_N/HOST/rank_R/stderr.log

RUN is the run id (`fdl run`: its first attempt's, so that the attempts of one run sit side by side), N
the world's restart count (0 first), HOST this agent's roster name, R the global rank. A stream gets its
file only when `--redirects` or `--tee` names it for that local rank (torchrun's rule). Directories are
created 0700 and files 0600 (rank output may hold secrets); a file is appended to, never followed
through a symlink, and stops growing at `max_file_bytes` (one line says so).

DIR is only ever this host's own setting (the agent spec from `fdl run`/`fdl join`): the controller's
messages supply the run id and the restart count, and the run id becomes one path component after
`component` has made it safe, so a controller cannot make a walk-in write outside DIR.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flodld.config.logs import DEFAULT_MAX_FILE_MB, ERR, OUT, file_and_console, parse_std

STREAMS = (("stdout", OUT), ("stderr", ERR))
DIR_MODE, FILE_MODE = 0o700, 0o600
MAX_COMPONENT = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class LogDirError(OSError):
    """A log directory that cannot be made or written; the message names the path and the fix."""


class RankLogSpec(BaseModel):
    """The agent spec's `logs`: where and what this host writes of its ranks' output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Annotated[str, Field(min_length=1, max_length=4096)]
    redirects: Annotated[str, Field(max_length=4096)] = "0"
    tee: Annotated[str, Field(max_length=4096)] = "0"
    # The run's directory name; None: the formed world's run id. `fdl run` sets its first attempt's id.
    run: Annotated[str, Field(min_length=1, max_length=MAX_COMPONENT)] | None = None
    max_file_bytes: Annotated[int, Field(ge=1)] = DEFAULT_MAX_FILE_MB << 20

    @field_validator("redirects", "tee")
    @classmethod
    def _parses(cls, value: str) -> str:
        parse_std(value)
        return value

    def streams(self, local_rank: int) -> tuple[int, int]:
        """(streams to file, streams to the console) of `local_rank`."""
        return file_and_console(parse_std(self.redirects, "--redirects"), parse_std(self.tee, "--tee"),
                                local_rank)  # fmt: skip

    @property
    def writes_files(self) -> bool:
        """Whether any local rank gets a file (--log-dir alone writes nothing, as under torchrun)."""
        return any(
            value if isinstance(value, int) else any(value.values())
            for value in (parse_std(self.redirects), parse_std(self.tee))
        )


def component(name: str) -> str:
    """`name` as one safe path component: [A-Za-z0-9_.-] only (anything else becomes '_'), never
    starting with '.', at most MAX_COMPONENT characters.
    """
    safe = _UNSAFE.sub("_", name)[:MAX_COMPONENT]
    return safe if safe and not safe.startswith(".") else "_" + safe[: MAX_COMPONENT - 1]


def attempt_dir(base: Path | str, run: str, attempt: int) -> Path:
    return Path(base) / component(run) / f"attempt_{int(attempt)}"


def rank_dir(base: Path | str, run: str, attempt: int, host: str, rank: int) -> Path:
    return attempt_dir(base, run, attempt) / component(host) / f"rank_{int(rank)}"


def prepare_log_dir(path: Path | str, what: str = "log directory") -> Path:
    """Make `path` (each missing level 0700) and check it is a directory this process can write.

    LogDirError names the path and says what to do.
    """
    target = Path(os.path.abspath(path))
    missing: list[Path] = []
    probe = target
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        for level in reversed(missing):
            try:
                os.mkdir(level, DIR_MODE)
            except FileExistsError:
                pass
        info = os.stat(target)
    except OSError as error:
        raise LogDirError(
            f"{what} {target} cannot be created ({error.strerror or error}); give a directory you can write"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise LogDirError(f"{what} {target} is not a directory; give a directory (it is made if missing)")
    if not os.access(target, os.W_OK | os.X_OK):
        raise LogDirError(f"{what} {target} is not writable by this user; give a directory you can write")
    return target


class RankLogSink:
    """One rank's log files: what the agent writes of each output line it reads from the rank.

    `write(stream, line)` appends to that stream's file when it has one; `shows(stream)` says whether
    the line also goes to the console. Blocking writes of one line each: the agent's loop reads a line,
    writes it, reads the next (a rank's pipe is the back-pressure).
    """

    def __init__(self, directory: Path | None, files: int, console: int, max_bytes: int) -> None:
        self.directory = directory
        self.console = console
        self.max_bytes = max_bytes
        self.fds: dict[str, int] = {}
        self.written: dict[str, int] = {}
        if directory is None:
            return
        prepare_log_dir(directory, "rank log directory")
        try:
            for name, bit in STREAMS:
                if files & bit:
                    path = directory / f"{name}.log"
                    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
                    self.fds[name] = os.open(path, flags, FILE_MODE)
                    self.written[name] = os.fstat(self.fds[name]).st_size
        except OSError as error:
            self.close()
            raise LogDirError(f"rank log file {error.filename} cannot be opened ({error.strerror})") from None

    @classmethod
    def for_rank(
        cls, spec: RankLogSpec | None, *, run: str, attempt: int, host: str, rank: int, local_rank: int
    ) -> RankLogSink:
        """The sink of one rank under `spec` (a sink that writes nothing and shows all without one)."""
        if spec is None:
            return cls(None, 0, OUT | ERR, 0)
        files, console = spec.streams(local_rank)
        directory = rank_dir(spec.dir, spec.run or run, attempt, host, rank) if files else None
        return cls(directory, files, console, spec.max_file_bytes)

    @property
    def splits_streams(self) -> bool:
        """Whether stdout and stderr must be read apart (one of them has a file or stays off the console)."""
        return bool(self.fds) or self.console != OUT | ERR

    def shows(self, stream: str) -> bool:
        return bool(self.console & dict(STREAMS)[stream])

    def write(self, stream: str, line: bytes) -> None:
        fd = self.fds.get(stream)
        if fd is None:
            return
        written = self.written[stream]
        if written >= self.max_bytes:
            return
        if written + len(line) > self.max_bytes:
            line = (
                f"[fdl: {stream}.log reached its cap of {self.max_bytes} bytes (logs.max_file_mb); the rest "
                "of this rank's output to it is dropped]\n"
            ).encode()
            self.written[stream] = self.max_bytes
        else:
            self.written[stream] = written + len(line)
        try:
            os.write(fd, line)
        except OSError:  # a full disk ends the file, never the rank
            self.written[stream] = self.max_bytes

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def open_rank_sinks(
    logs: RankLogSpec | None, *, run: str, attempt: int, host: str, ranks: list[int]
) -> tuple[list[RankLogSink], str | None]:
    """Each rank's sink under this host's own log directory (never one the controller names: the run id is
    made one safe path component), and a line saying where they write, if any writes. An OSError
    (LogDirError) names the path; the sinks opened before it are closed.
    """
    sinks: list[RankLogSink] = []
    try:
        for local_rank, rank in enumerate(ranks):
            sinks.append(RankLogSink.for_rank(
                logs, run=run, attempt=attempt, host=host, rank=rank, local_rank=local_rank
            ))  # fmt: skip
    except OSError:
        for sink in sinks:
            sink.close()
        raise
    if logs is None or not any(sink.fds for sink in sinks):
        return sinks, None
    where = attempt_dir(logs.dir, logs.run or run, attempt) / component(host)
    return sinks, f"rank logs in {where} (redirects {logs.redirects}, tee {logs.tee})"
