"""How tests start a program in the agent role: its spec in the environment, its output on one pipe."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec


async def start_agent(
    program: Path,
    spec: AgentSpec,
    env: Mapping[str, str],
    *wrapper: str,
    new_session: bool = False,
    args: Sequence[str] = (),
) -> asyncio.subprocess.Process:
    """`WRAPPER python PROGRAM ARGS` with SPEC in AGENT_ENV over ENV; stdout and stderr together on `.stdout`
    (the ranks run PROGRAM with the same ARGS).
    """
    return await asyncio.create_subprocess_exec(
        *wrapper, sys.executable, str(program), *args, env={**env, AGENT_ENV: encode_spec(spec)},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=new_session,
    )  # fmt: skip
