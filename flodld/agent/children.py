"""The agent's children as its shell sees them: each process with its rank, output tail and error file; their
output copied to the agent's with a prefix naming host and role (and to a rank's log files); a rank's exit
as the report the controller gets; and the agent's own console lines (`say`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flodld.agent import supervision as sv
from flodld.agent.ranklogs import RankLogSink
from flodld.agent.tail import OutputTail
from flodld.wire.join import RankExited
from flodld.wire.messages import MAX_REASON_CHARS


def say(message: str) -> None:
    sys.stderr.write(f"flodld agent: {message}\n")  # one write, so lines never interleave
    sys.stderr.flush()


class ChildProcess(Protocol):
    """What the agent uses of a child: a process it started, or a rank its host's fork server forked
    (flodld.agent.forkserver.ForkedRank).
    """

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    @property
    def stderr(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...


@dataclass
class Child:
    label: str
    process: ChildProcess
    rank: int | None  # None for the relay
    tail: OutputTail | None = None  # a rank's last output lines, for its exit report
    error_file: Path | None = None  # the rank's TORCHELASTIC_ERROR_FILE


async def forward_output(child: Child, prefix: str, sink: RankLogSink | None = None) -> None:
    """Copy the child's output line by line with a prefix naming host and role; a rank's `sink` (its log
    files, --redirects/--tee) gets each line first and says whether the console shows it too.
    """
    assert child.process.stdout is not None
    streams = [("stdout", child.process.stdout)]
    if child.process.stderr is not None:  # spawned with stderr apart (per-rank log files)
        streams.append(("stderr", child.process.stderr))
    await asyncio.gather(*(_forward_stream(stream, n, prefix, sink, child.tail) for n, stream in streams))


async def _forward_stream(
    stream: asyncio.StreamReader, name: str, prefix: str, sink: RankLogSink | None, tail: OutputTail | None
) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        if tail is not None:  # the root cause's tail: a separate small ring
            tail.feed(line, time.time())
        if sink is not None:
            sink.write(name, line)
            if not sink.shows(name):
                continue
        sys.stdout.write(prefix + line.decode(errors="replace"))
        if not line.endswith(b"\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()


def exit_report(rank: int, code: int, torn_down: bool, detail: sv.ExitDetail) -> RankExited:
    """The report of one rank's exit, every field within its wire cap. Should the detail not validate, the
    exit is still reported (without it): an unreported rank would count as a lost host.
    """
    code = max(-128, min(255, code))
    try:
        return RankExited(
            rank=rank,
            code=code,
            failed_at=detail.failed_at,
            torn_down=torn_down,
            error=detail.error[:MAX_REASON_CHARS] if detail.error else None,
            tail=detail.tail,
        )
    except ValueError as error:
        say(f"rank {rank}'s failure detail left out of its exit report ({error})")
        return RankExited(rank=rank, code=code, torn_down=torn_down)
