"""The `local_devices:` syntax: which ranks a worker runs, one rank per entry.

Written forms (YAML or builder):

- `0`, `1`, ... or `"cuda:0"`  one rank on that CUDA device (physical index)
- `"cpu"`                      one CPU rank
- `"cpu:K"`                    K CPU ranks (a count, not an index)
- `"all"` (instead of a list)  every GPU the host has, counted at dispatch

Each list entry is normalised to `"cuda:N"`, `"cpu"` or `"cpu:K"` (K >= 2) so that a builder and a YAML
file that mean the same thing compare equal. `rank_labels` expands a list to the per-rank labels that
travel in `Hello.devices` (`"cuda:1"`, `"cpu:0"`, `"cpu:1"`, where a CPU label's number is the CPU rank's
ordinal on that host).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Discriminator, Tag

MAX_CUDA_INDEX = 255
MAX_CPU_RANKS_PER_ENTRY = 1024

ALL_DEVICES: Literal["all"] = "all"

_CUDA_RE = re.compile(r"^cuda:(\d+)$")
_CPU_RE = re.compile(r"^cpu(?::(\d+))?$")

_SYNTAX_HELP = 'use a CUDA index (0), "cuda:N", "cpu" (one CPU rank) or "cpu:K" (K CPU ranks)'


def _check_cuda_index(index: int) -> str:
    if not 0 <= index <= MAX_CUDA_INDEX:
        raise ValueError(f"CUDA index {index} is out of range; expected 0..{MAX_CUDA_INDEX}")
    return f"cuda:{index}"


def normalize_device_entry(value: object) -> str:
    """One written entry -> its canonical string; ValueError naming the accepted forms otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a device; {_SYNTAX_HELP}")
    if isinstance(value, int):
        return _check_cuda_index(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a device; {_SYNTAX_HELP}")
    text = value.strip().lower()
    cuda = _CUDA_RE.match(text)
    if cuda:
        return _check_cuda_index(int(cuda.group(1)))
    cpu = _CPU_RE.match(text)
    if cpu:
        if cpu.group(1) is None:
            return "cpu"
        count = int(cpu.group(1))
        if count == 0:
            raise ValueError(f'{value!r} asks for zero CPU ranks; write "cpu" for one rank or "cpu:K" for K')
        if count > MAX_CPU_RANKS_PER_ENTRY:
            raise ValueError(
                f"{value!r} asks for {count} CPU ranks; at most {MAX_CPU_RANKS_PER_ENTRY} per entry"
            )
        return "cpu" if count == 1 else f"cpu:{count}"
    if text == ALL_DEVICES:
        raise ValueError('"all" replaces the whole list (local_devices: all), it cannot be a list entry')
    raise ValueError(f"{value!r} is not a device; {_SYNTAX_HELP}")


def entry_rank_count(entry: str) -> int:
    """How many ranks one canonical entry stands for."""
    if entry.startswith("cpu:"):
        return int(entry.removeprefix("cpu:"))
    return 1


def rank_labels(entries: tuple[str, ...]) -> list[str]:
    """Canonical entries -> one `Hello.devices` label per rank, CUDA ids kept, CPU ranks numbered from 0."""
    labels: list[str] = []
    cpu_ordinal = 0
    for entry in entries:
        if entry.startswith("cuda:"):
            labels.append(entry)
            continue
        for _ in range(entry_rank_count(entry)):
            labels.append(f"cpu:{cpu_ordinal}")
            cpu_ordinal += 1
    return labels


def _check_device_list(entries: tuple[str, ...]) -> tuple[str, ...]:
    if not entries:
        raise ValueError(
            'the list is empty; a worker with no ranks cannot train (list devices, or write "all")'
        )
    seen: set[str] = set()
    for entry in entries:
        if entry.startswith("cuda:"):
            if entry in seen:
                raise ValueError(f"{entry} is listed twice; each CUDA device carries at most one rank")
            seen.add(entry)
    return entries


def _reject_scalar(value: object) -> object:
    if value == ALL_DEVICES or not isinstance(value, str | int):
        return value
    try:
        normalize_device_entry(value)
    except ValueError:
        raise ValueError(f'expected "all" or a list of devices, got {value!r}; {_SYNTAX_HELP}') from None
    raise ValueError(f'expected "all" or a list of devices, got {value!r}; write it as a list: [{value!r}]')


DeviceEntry = Annotated[str, BeforeValidator(normalize_device_entry)]
"""One list entry, normalised."""

DeviceList = Annotated[tuple[DeviceEntry, ...], AfterValidator(_check_device_list)]
"""An explicit, non-empty device list without duplicate CUDA ids."""


def _spec_branch(value: object) -> str:
    return "all" if isinstance(value, str) else "list"


DeviceSpec = Annotated[
    Annotated[Literal["all"], Tag("all")] | Annotated[DeviceList, Tag("list")],
    Discriminator(_spec_branch),
    BeforeValidator(_reject_scalar),
]
"""What `local_devices:` (and the walk-in `join.devices:`) accept."""


def spec_rank_count(spec: Literal["all"] | tuple[str, ...]) -> int | None:
    """Ranks an explicit list carries; None for "all" (known only once the host is probed)."""
    if spec == ALL_DEVICES:
        return None
    return sum(entry_rank_count(entry) for entry in spec)


def spec_has_cpu(spec: Literal["all"] | tuple[str, ...]) -> bool:
    return spec != ALL_DEVICES and any(entry.startswith("cpu") for entry in spec)
