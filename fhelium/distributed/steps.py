"""The steps every typed collective of fhelium.distributed takes, public for other collective code.

A collective that moves fhelium values (or any tensors whose layout the ranks must agree on) first has
each rank describe its value (`describe_or_error`), exchanges those descriptions with the group's
`ProcessGroup` facts in one small control all-gather (`group_info`, `rank_body`, `exchange_control`),
then lets every rank decide the same thing from the same records (`agree`, with
`check_identical_layouts` as the common check; `agree_on_layout` is that exchange and that check in one
call, for ranks that must hold identical layouts), so that a mismatch raises the same
`CollectiveArgumentError` on every rank before any payload moves and the group stays usable.
fhelium.distributed's own collectives are built from these; so is the Backend's (a compiled
Program's broadcast and all-reduce), which is why they are a public module rather than private names.
"""

from __future__ import annotations

from fhelium.distributed._collective_common import (
    CollectiveArgumentError,
    ControlExchange,
    GroupInfo,
    agree,
    agree_on_layout,
    check_identical_layouts,
    describe_or_error,
    exchange_control,
    group_info,
    rank_body,
)

__all__ = [
    "CollectiveArgumentError",
    "ControlExchange",
    "GroupInfo",
    "agree",
    "agree_on_layout",
    "check_identical_layouts",
    "describe_or_error",
    "exchange_control",
    "group_info",
    "rank_body",
]
