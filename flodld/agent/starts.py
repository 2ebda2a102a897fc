"""How the agent's children start: forked by its host's fork server, handed to a warm rank, or cold.

Each way says why it was not taken (flodld.agent.forkserver, flodld.agent.warmpool); a cold start is the
fallback that always exists.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence

from flodld.agent.children import ChildProcess
from flodld.agent.forkserver import ForkServer
from flodld.agent.spawn import relay_command, relay_environment, relay_spec_for, spawn_child
from flodld.agent.warmpool import WarmPool
from flodld.rank.warm import FIRST_PASSED_FD
from flodld.wire.join import WorldFormed


async def start_relay(
    forks: ForkServer | None,
    formed: WorldFormed,
    *,
    host: str,
    salt: bytes,
    host_key: bytes,
    listener: socket.socket,
    say: Callable[[str], None],
) -> ChildProcess:
    """This host's relay, serving the ranks' `listener` (closed here: the relay owns it now). Forked, its
    fold's torch is loaded already and its spec finds the listener at FIRST_PASSED_FD.
    """
    def environment(listen_fd: int) -> dict[str, str]:
        spec = relay_spec_for(formed, host=host, salt=salt, host_key=host_key, listen_fd=listen_fd)
        return relay_environment(os.environ, spec)

    relay: ChildProcess | None = None
    try:
        if forks is not None:
            relay = await forks.take_relay(environment(FIRST_PASSED_FD), listener.fileno(), say)
        if relay is None:
            fd = listener.fileno()
            relay = await spawn_child(relay_command(), environment(fd), pass_fds=[fd])
    finally:
        listener.close()
    return relay


async def start_rank(
    warm: WarmPool | None,
    forks: ForkServer | None,
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    device: str,
    split_stderr: bool,
    say: Callable[[str], None],
) -> ChildProcess:
    """One rank: a warm rank of `fdl run`'s agent (never for split streams: its stderr shares its stdout
    pipe), else forked by the host's fork server, else cold.
    """
    process: ChildProcess | None = None
    if warm is not None and not split_stderr:
        process = await warm.take(argv, env, say)
    if process is None and forks is not None:
        process = await forks.take(argv, env, device=device, split_stderr=split_stderr, say=say)
    if process is None:
        process = await spawn_child(argv, env, split_stderr=split_stderr)
    return process
