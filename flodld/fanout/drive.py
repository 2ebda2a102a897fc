"""The loop every run shell shares: the run supervisor's actions carried out, its events fed back.

`fdl run` (local agents, `clients/fdl/runshell.py`) and the SSH fan-out (`cluster_run.py`) own different
processes but drive `RunSupervisor` the same way: SIGINT/SIGTERM become `Interrupted`, each action is
carried out in order until one sets the exit code, and the shell is closed however the run ends.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Protocol

from flodld.membership.supervisor import Action, Interrupted, RunSupervisor


class SupervisedShell(Protocol):
    """What `drive_run` needs of a shell: its event queue, the action carrier, the exit code, the close."""

    @property
    def events(self) -> asyncio.Queue[Any]: ...
    @property
    def exit_code(self) -> int | None: ...
    async def carry_out(self, action: Action) -> None: ...
    async def close(self) -> None: ...


async def drive_run(supervisor: RunSupervisor, shell: SupervisedShell) -> int:
    """Run `supervisor`'s decisions through `shell` until it finishes; the run's exit code."""
    loop = asyncio.get_running_loop()
    interrupted = Interrupted("interrupted by the operator")
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, shell.events.put_nowait, interrupted)
    try:
        actions = list(supervisor.start())
        while True:
            for action in actions:
                await shell.carry_out(action)
                if shell.exit_code is not None:
                    return shell.exit_code
            actions = list(supervisor.handle(await shell.events.get()))
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await shell.close()
