"""flodld: a controller daemon for distributed torch runs across hosts.

The user-facing entry is `flodld.run(main)`; everything else is imported lazily so that
`import flodld` stays cheap in the agent and relay roles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run(main: Callable[[], T], *, init_process_group: bool = True) -> T:
    """Run `main` as this process's role wants: agent/relay roles run and exit here; a rank gets
    its process group initialised (unless told not to) and runs `main`; a plain process just runs it.

    A rank's process group is destroyed when `main` returns or raises, before interpreter
    shutdown, where gloo's teardown can abort a process whose peers have already left.
    No barrier: in an elastic world a rank may leave while its peers keep going.
    """
    from flodld.launcher import Role, current_role, exit_if_worker_role

    exit_if_worker_role()
    if current_role() is not Role.RANK:
        return main()
    if init_process_group:
        from flodld.rank import init_process_group as init

        init()
    from flodld.rank.process_group import close_process_group

    try:
        return main()
    finally:
        close_process_group()


__all__ = ["run"]
