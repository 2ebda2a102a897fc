"""The agent's warm ranks (flodld.rank.warm): started before the world forms, handed over or stopped.

A warm rank is used for local rank i when the rank command is this interpreter's `-m
flodld.launcher.rank SCRIPT.py ...`, the warm process is still alive, and its start-up environment
equals the rank's (`startup_differences`); otherwise it is stopped and the rank starts cold, with one
line saying why. Every warm rank not handed over is killed with its process group when the pool closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Mapping, Sequence

from flodld.agent.spawn import signal_group, spawn_warm, warm_environment, warm_handoff_argv
from flodld.rank.warm import encode_handoff, startup_differences


class WarmPool:
    """Warm ranks of one agent, taken in order by local rank."""

    def __init__(self, processes: list[tuple[asyncio.subprocess.Process, dict[str, str]]]) -> None:
        self._ready = processes  # (process, the environment it started with)
        self.used = 0

    @classmethod
    async def start(cls, count: int, parent: Mapping[str, str]) -> WarmPool:
        """`count` warm ranks for a host that will run `count` CPU ranks (none when count is 0)."""
        env = warm_environment(parent, local_world_size=count)
        processes = []
        try:
            for _ in range(count):
                processes.append((await spawn_warm(env), env))
        except OSError:
            for process, _ in processes:
                signal_group(process, signal.SIGKILL)
            raise
        return cls(processes)

    def __len__(self) -> int:
        return len(self._ready)

    async def take(
        self, argv: Sequence[str], env: Mapping[str, str], say: Callable[[str], None]
    ) -> asyncio.subprocess.Process | None:
        """The next warm rank, become the rank `argv` with `env`; None when none fits (start it cold)."""
        if not self._ready:
            return None
        handoff = warm_handoff_argv(argv)
        process, warm_env = self._ready.pop(0)
        differences = startup_differences(warm_env, env)
        if handoff is None or differences or process.returncode is not None or process.stdin is None:
            why = (
                "the program is not a Python script"
                if handoff is None
                else f"start-up variables differ ({', '.join(differences)})"
                if differences
                else "it is gone"
            )
            say(f"warm rank not used, starting the rank cold: {why}")
            await self._stop(process)
            return None
        try:
            process.stdin.write(encode_handoff(handoff, env))
            await process.stdin.drain()
            process.stdin.close()
        except (ConnectionError, OSError) as error:
            say(f"warm rank not used, starting the rank cold: hand-off failed ({error})")
            await self._stop(process)
            return None
        self.used += 1
        return process

    async def close(self) -> None:
        """Stop every warm rank not handed over."""
        ready, self._ready = self._ready, []
        for process, _ in ready:
            await self._stop(process)

    @staticmethod
    async def _stop(process: asyncio.subprocess.Process) -> None:
        signal_group(process, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await process.wait()
