"""`fdl` as a real process, for the client tests that drive it against a live daemon."""

from __future__ import annotations

import asyncio
import os
import sys

NO_FDL_ENV = ("FDL_ENV",)


async def fdl(
    *args: str, env: dict[str, str] | None = None, cwd: str | None = None, drop: tuple[str, ...] = NO_FDL_ENV
) -> tuple[int, str, str]:
    """`python -m fdl.main ARGS` to its end (30 s at most): (exit code, stdout, stderr).

    Its environment is this process's less the names in DROP, plus ENV.
    """
    inherited = {name: value for name, value in os.environ.items() if name not in drop}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fdl.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env={**inherited, **(env or {})},
        cwd=cwd,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
