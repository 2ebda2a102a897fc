"""What a rank sees: a plain torch environment, a ready process group, and optional CPU averaging.

Imports are lazy so that the agent (which only needs the environment names) never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flodld.rank.env import RankEnvError, RankEnvironment, in_flodld_rank, read_rank_environment

if TYPE_CHECKING:
    from flodld.rank.process_group import init_process_group, rank_device

__all__ = [
    "RankEnvError",
    "RankEnvironment",
    "in_flodld_rank",
    "init_process_group",
    "rank_device",
    "read_rank_environment",
]


# PEP 562: the lazily loaded function; type checkers see its real type through the TYPE_CHECKING import.
def __getattr__(name: str) -> Any:  # noqa: ANN401  the function's own type, see above
    if name in ("init_process_group", "rank_device"):
        from flodld.rank import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'flodld.rank' has no attribute {name!r}")
