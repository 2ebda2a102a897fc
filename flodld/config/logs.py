"""Per-rank log files: torchrun's `--redirects`/`--tee` syntax and the top-level `logs:` block of fdl.yml.

A value is torchrun's (`torch.distributed.elastic.multiprocessing.Std.from_str`): one digit for every
local rank, `0` nothing, `1` stdout, `2` stderr, `3` both; or a per-local-rank map `0:1,1:2` (local
ranks it leaves out get `0`). `--redirects` sends a stream to its file *instead of* the console,
`--tee` to its file *and* the console (a stream named by both is teed, as under torchrun).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flodld.config.fields import Text

OUT, ERR = 1, 2
"""The bits of a stream mask: stdout, stderr (3 is both)."""

STREAM_BITS = {"stdout": OUT, "stderr": ERR}

DEFAULT_MAX_FILE_MB = 1024
"""A rank's stdout.log or stderr.log stops growing past this many MiB (a line says so at the cap)."""

MAX_LOCAL_RANK = 1 << 20
_VALUE = re.compile(r"^[0123]$")
_MAPPING = re.compile(r"^(\d+:[0123],)*\d+:[0123]$")

StdValue = int | dict[int, int]


def parse_std(text: str, flag: str = "--redirects") -> StdValue:
    """A --redirects/--tee value as torchrun reads it: '3' -> 3 (every local rank), '0:1,1:2' -> {0: 1, 1: 2}.

    ValueError names the flag, the value and the accepted forms.
    """
    value = text.strip().replace(" ", "")
    if _VALUE.match(value):
        return int(value)
    if _MAPPING.match(value):
        mapping: dict[int, int] = {}
        for pair in value.split(","):
            rank, _, bits = pair.partition(":")
            local = int(rank)
            if local in mapping or local > MAX_LOCAL_RANK:
                raise ValueError(f"{flag} {text!r}: local rank {local} is given twice or is out of range")
            mapping[local] = int(bits)
        return mapping
    raise ValueError(
        f"{flag} {text!r} is not understood: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every "
        "local rank, or LOCAL_RANK:N pairs separated by commas (e.g. 0:3,1:2), as torchrun"
    )


def std_for(value: StdValue, local_rank: int) -> int:
    """The stream mask `value` gives `local_rank` (0 for a local rank a map leaves out)."""
    return value if isinstance(value, int) else value.get(local_rank, 0)


def file_and_console(redirects: StdValue, tee: StdValue, local_rank: int) -> tuple[int, int]:
    """(streams written to the rank's files, streams shown on the console) for one local rank.

    As torchrun: a redirected stream goes to its file only, a teed one to its file and the console, one
    named by neither to the console only.
    """
    redirected, teed = std_for(redirects, local_rank), std_for(tee, local_rank)
    files = redirected | teed
    return files, (OUT | ERR) & ~(files & ~teed)


def _std_text(value: str, flag: str) -> str:
    parse_std(value, flag)
    return value.strip().replace(" ", "")


class LogsConfig(BaseModel):
    """Top-level `logs:`: this host's per-rank log files, for `fdl run` and `fdl join` (flags win).

    Always this host's own setting: a controller never chooses where a walk-in writes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Text | None = None
    redirects: Annotated[str, Field(max_length=4096)] = "0"
    tee: Annotated[str, Field(max_length=4096)] = "0"
    max_file_mb: Annotated[int, Field(strict=True, ge=1, le=1 << 20)] = DEFAULT_MAX_FILE_MB

    @field_validator("redirects", "tee", mode="before")
    @classmethod
    def _std_parses(cls, value: object, info: ValidationInfo) -> object:
        """`redirects: 3` (a YAML number) is as good as `redirects: "3"`; either must parse."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        return _std_text(value, f"logs.{info.field_name}") if isinstance(value, str) else value
