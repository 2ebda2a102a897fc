"""`fdl logs [RUN] [--rank R] [--attempt N] [--host H] [--stream stdout|stderr] [--follow] [--log-dir DIR]`.

Shows the per-rank log files that `fdl run` or `fdl join` wrote on this host (with --log-dir and
--redirects/--tee, or the `logs:` block of fdl.yml). They are laid out as

    DIR/RUN/attempt_N/HOST/rank_R/stdout.log   (and stderr.log)

DIR is --log-dir, else `logs.dir` of fdl.yml. RUN defaults to the latest run in DIR (a unique prefix of
its id is enough), the attempt to its latest. With one file to show its lines are printed as they are;
with several, each line is prefixed `[HOST:rR:STREAM] `. --follow keeps printing what the ranks append
(and, without --attempt, moves on to a restart's new attempt) until interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fdl.cli import Command
from flodld import api

EXIT_OK, EXIT_NOTHING, EXIT_USAGE = 0, 1, 2
FOLLOW_POLL_SECS = 0.25
READ_CHUNK = 1 << 20
_ATTEMPT = re.compile(r"^attempt_(\d+)$")
_RANK = re.compile(r"^rank_(\d+)$")


def resolve_logs(
    *,
    log_dir: str | None,
    redirects: str | None,
    tee: str | None,
    block: api.LogsConfig | None,
    say: Callable[[str], None],
) -> api.RankLogSpec | None:
    """The agent spec's `logs` from --log-dir/--redirects/--tee over fdl.yml's `logs:` block (flags win).

    As torchrun: nothing is written unless --redirects or --tee names a stream (--log-dir alone writes no
    rank file: a line says so), and without a directory the files go to a fresh temporary one (a line names
    it). The directory is made (0700) and checked here, before anything starts: ValueError names the path.
    """
    block = block or api.LogsConfig()
    directory = log_dir if log_dir is not None else block.dir
    spec_redirects = redirects if redirects is not None else block.redirects
    spec_tee = tee if tee is not None else block.tee
    api.parse_std(spec_redirects, "--redirects")  # ValueError names the flag and the forms
    api.parse_std(spec_tee, "--tee")
    try:
        cap = block.max_file_mb << 20
        spec = api.RankLogSpec(dir=directory or "-", redirects=spec_redirects, tee=spec_tee,
                               max_file_bytes=cap)  # fmt: skip
        if not spec.writes_files:
            if directory is not None:
                api.prepare_log_dir(directory)
                say(
                    f"--log-dir {directory} without --redirects/--tee writes no rank file (as torchrun): add "
                    "--tee 3 to keep every rank's stdout and stderr there as well as on the console"
                )
            return None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="fdl-logs-")  # 0700, as torchrun's torchelastic_ directory
            say(f"no --log-dir (or logs.dir): rank logs go to the new directory {directory}")
        return spec.model_copy(update={"dir": str(api.prepare_log_dir(directory))})
    except api.LogDirError as error:
        raise ValueError(f"--log-dir: {error}") from None


def config_logs(project: str, env: str | None) -> api.LogsConfig | None:
    """fdl.yml's `logs:` block (with the selected overlay), or None without one or without fdl.yml."""
    try:
        return api.load_config(project, env or os.environ.get("FDL_ENV") or None).logs
    except api.ConfigNotFoundError:
        return None


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """--log-dir, -r/--redirects, -t/--tee, as torchrun spells them (and fdl join takes them too)."""
    parser.add_argument(
        "--log-dir", "--log_dir", dest="log_dir", default=None, metavar="DIR",
        help="base directory of the per-rank log files (default: logs.dir in fdl.yml)",
    )  # fmt: skip
    parser.add_argument(
        "-r", "--redirects", dest="redirects", default=None, metavar="N|LR:N,...",
        help="send ranks' streams to their files instead of the console: 0 none, 1 stdout, 2 stderr, 3 both; "
        "or per local rank, e.g. 0:3,1:2 (as torchrun)",
    )  # fmt: skip
    parser.add_argument(
        "-t", "--tee", dest="tee", default=None, metavar="N|LR:N,...",
        help="write ranks' streams to their files and the console (values as --redirects)",
    )  # fmt: skip


@dataclass(frozen=True)
class LogFile:
    host: str
    rank: int
    stream: str
    path: Path

    @property
    def label(self) -> str:
        return f"[{self.host}:r{self.rank}:{self.stream}] "


def latest_run(base: Path) -> Path:
    """The run directory under `base` touched last (its newest attempt counts); FileNotFoundError when
    there is none.
    """
    runs = [entry for entry in base.iterdir() if entry.is_dir() and attempts(entry)]
    if not runs:
        raise FileNotFoundError(f"no rank logs in {base} (none of RUN/attempt_N/HOST/rank_R/ is there)")

    def touched(run: Path) -> float:
        return max(path.stat().st_mtime for path in (run, *attempts(run).values()))

    return max(runs, key=touched)


def attempts(run: Path) -> dict[int, Path]:
    """The attempt directories of a run, by number."""
    found: dict[int, Path] = {}
    for entry in run.iterdir() if run.is_dir() else ():
        match = _ATTEMPT.match(entry.name)
        if match and entry.is_dir():
            found[int(match[1])] = entry
    return found


def find_run(base: Path, name: str | None) -> Path:
    """RUN's directory (its id, or a unique prefix of it), else the latest; FileNotFoundError names `base`."""
    if not base.is_dir():
        raise FileNotFoundError(f"log directory {base} does not exist (give the --log-dir the run used)")
    if name is None:
        return latest_run(base)
    exact = base / api.component(name)
    if exact.is_dir():
        return exact
    matches = sorted(entry for entry in base.iterdir() if entry.is_dir() and entry.name.startswith(name))
    if len(matches) == 1:
        return matches[0]
    runs = ", ".join(entry.name for entry in sorted(base.iterdir()) if entry.is_dir()) or "none"
    what = "matches more than one run" if matches else "names no run"
    raise FileNotFoundError(f"{name!r} {what} in {base} (runs: {runs})")


def log_files(attempt: Path, *, rank: int | None, host: str | None, stream: str | None) -> list[LogFile]:
    """The attempt's log files that match the filters, ordered by host, rank and stream."""
    files: list[LogFile] = []
    for host_dir in sorted(attempt.iterdir()) if attempt.is_dir() else ():
        if not host_dir.is_dir() or (host is not None and host_dir.name != api.component(host)):
            continue
        for rank_dir in host_dir.iterdir():
            match = _RANK.match(rank_dir.name)
            if match is None or (rank is not None and int(match[1]) != rank):
                continue
            for name in ("stdout", "stderr"):
                path = rank_dir / f"{name}.log"
                if (stream is None or stream == name) and path.is_file():
                    files.append(LogFile(host_dir.name, int(match[1]), name, path))
    return sorted(files, key=lambda file: (file.host, file.rank, file.stream != "stdout"))


class Printer:
    """Prints new lines of log files (whole lines; a partial last line waits for its end, unless final)."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}

    def pump(self, files: list[LogFile], *, labelled: bool, final: bool) -> None:
        for file in files:
            try:
                with open(file.path, "rb") as handle:
                    handle.seek(self.offsets.get(file.path, 0))
                    while chunk := handle.read(READ_CHUNK):
                        self.offsets[file.path] = handle.tell()
                        self._emit(file, chunk, labelled=labelled)
            except FileNotFoundError:
                continue
            if final and self.partial.get(file.path):
                self._emit(file, b"\n", labelled=labelled)

    def _emit(self, file: LogFile, chunk: bytes, *, labelled: bool) -> None:
        lines = (self.partial.pop(file.path, b"") + chunk).split(b"\n")
        if lines[-1]:
            self.partial[file.path] = lines[-1]
        label = file.label.encode() if labelled else b""
        self.out(b"".join(label + line + b"\n" for line in lines[:-1]))


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", default=None, help="run id or unique prefix (default: the latest)")
    parser.add_argument("--rank", type=int, default=None, help="only this (global) rank's files")
    parser.add_argument("--attempt", type=int, default=None, help="this attempt (default: the run's latest)")
    parser.add_argument("--host", default=None, help="only this host's files (its roster name)")
    parser.add_argument("--stream", choices=("stdout", "stderr"), default=None, help="only this stream")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    parser.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None, metavar="DIR",
                        help="the log directory (default: logs.dir in fdl.yml)")  # fmt: skip
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    try:
        block = None if args.log_dir else config_logs(args.project, getattr(args, "env", None))
        directory = args.log_dir or (block.dir if block is not None else None)
    except api.ConfigError as error:
        print(f"fdl logs: fdl.yml: {error}", file=sys.stderr)
        return EXIT_USAGE
    if directory is None:
        print("fdl logs: no log directory: give --log-dir DIR (the one fdl run/fdl join wrote to) or set "
              "logs.dir in fdl.yml", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    base = Path(directory)
    printer = Printer(_out)
    shown: Path | None = None
    try:
        while True:
            try:
                run = find_run(base, args.run)
                numbered = attempts(run)
                if args.attempt is not None and args.attempt not in numbered:
                    raise FileNotFoundError(
                        f"run {run.name} has no attempt {args.attempt} in {base} "
                        f"(attempts: {sorted(numbered)})"
                    )
                attempt = numbered[args.attempt if args.attempt is not None else max(numbered)]
                files = log_files(attempt, rank=args.rank, host=args.host, stream=args.stream)
                if not files and not args.follow:
                    filters = (("rank", args.rank), ("host", args.host), ("stream", args.stream))
                    wanted = " ".join(f"--{name} {value}" for name, value in filters if value is not None)
                    raise FileNotFoundError(
                        f"no log file in {attempt}" + (f" for {wanted}" if wanted else "")
                    )
            except FileNotFoundError as error:
                if not args.follow:
                    print(f"fdl logs: {error}", file=sys.stderr)
                    return EXIT_NOTHING
                time.sleep(FOLLOW_POLL_SECS)  # following: the run may not have written yet
                continue
            if args.follow and attempt != shown:
                if shown is not None:
                    print(f"fdl logs: now following {attempt}", file=sys.stderr)
                shown = attempt
            labelled = len(files) > 1 or (args.follow and (args.rank is None or args.stream is None))
            printer.pump(files, labelled=labelled, final=not args.follow)
            if not args.follow:
                return EXIT_OK
            time.sleep(FOLLOW_POLL_SECS)
    except KeyboardInterrupt:
        return EXIT_OK


COMMAND = Command("logs", "show a run's per-rank log files on this host", __doc__, configure_parser, main)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
