"""Binding an application-owned torch ProcessGroup as the `!fhelium_dist.group` resource.

The application calls `init_process_group` and `destroy_process_group`; the Backend only wraps the
group. Ranks in IR are group-relative; `global_rank` converts them for torch.distributed calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as torch_dist

from fhelium.backend.resources import BoundResource

PROCESS_GROUP_RESOURCE_KIND = "process-group"
DEFAULT_GROUP_SYMBOL = "world"


@dataclass(frozen=True)
class ProcessGroupExecutionResource:
    """A live process group; `group=None` means the default (world) group."""

    group: torch_dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not torch_dist.is_available() or not torch_dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call fhelium.distributed.init() (or "
                "torch.distributed.init_process_group) before binding a process group"
            )
        if self.group is not None and not isinstance(self.group, torch_dist.ProcessGroup):
            raise TypeError(f"group must be a torch ProcessGroup or None, got {type(self.group).__name__}")

    @property
    def process_group(self) -> torch_dist.ProcessGroup | None:
        return self.group

    @property
    def rank(self) -> int:
        return torch_dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return torch_dist.get_world_size(self.group)

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.size:
            raise IndexError(f"group rank {group_rank} is outside [0, {self.size})")
        if self.group is None:
            return group_rank
        return torch_dist.get_global_rank(self.group, group_rank)


def bind_process_group(
    group: torch_dist.ProcessGroup | None = None, *, symbol: str = DEFAULT_GROUP_SYMBOL
) -> BoundResource:
    """The binding for `fhelium.resource.ref {symbol = "world", kind = "process-group"}`."""
    return BoundResource(symbol, PROCESS_GROUP_RESOURCE_KIND, ProcessGroupExecutionResource(group))
