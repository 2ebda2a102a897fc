"""Child processes of the agent: their environments (pure) and how they are started.

The agent is flodld's own process (`python -m flodld.agent`, see `agent_command`) and so is the
relay (`python -m flodld.launcher`, which runs the role its environment names): the user's program
(`AgentSpec.program`) only ever starts as a rank. An agent spec without a program is the older
contract: the agent is the user's program itself (it called `exit_if_worker_role()`) and its ranks
re-enter it with the same interpreter and arguments. Secrets (the salt, the specs) ride the
environment, never argv.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

from flodld.agent.children import ChildProcess
from flodld.agent.spec import AGENT_ENV, encode_spec
from flodld.rank import env as rank_env
from flodld.rank.warm import FORK_SERVER_ENV, WARM_ENV, WARM_FLAG
from flodld.relay.spec import RELAY_ENV, RelayRoleSpec
from flodld.wire.join import WorldEnvelope, WorldFormed

ROLE_VARIABLES = (AGENT_ENV, RELAY_ENV, WARM_ENV, FORK_SERVER_ENV)
_PR_SET_PDEATHSIG = 1


def program_argv() -> list[str]:
    """The command that started this process, to re-enter the same program in another role."""
    return [sys.executable, *sys.orig_argv[1:]]


def agent_command(python: str | None = None) -> list[str]:
    """How a launcher starts an agent: flodld's own entry, never the user's program."""
    return [python or sys.executable, "-m", "flodld.agent"]


RELAY_HANDOFF = ["-m", "flodld.launcher"]
"""The argv of a fork request for a relay (flodld.launcher.forkserver): its command line after the
interpreter; every other request's argv is a rank's script and arguments."""


def relay_command() -> list[str]:
    """How the agent starts its relay: flodld's role dispatch (the relay spec is in its environment)."""
    return [sys.executable, *RELAY_HANDOFF]


def rank_command(program: Sequence[str] | None) -> list[str]:
    """The rank's command line: the spec's program, or (older contract) this process's own.

    A Python script (`[python, SCRIPT.py, *args]`) starts through `python -m flodld.launcher.rank`, which
    claims the salt and opens the rank's relay legs (heartbeats) before running the script unchanged: a
    stock script never imports flodld, and without heartbeats the controller would declare it dead once
    the startup grace is over. Any other program starts as given.
    """
    if not program:
        return program_argv()
    if len(program) >= 2 and program[1].endswith(".py"):
        return [program[0], "-m", "flodld.launcher.rank", *program[1:]]
    return list(program)


def warm_rank_command() -> list[str]:
    """A warm rank (flodld.rank.warm): the launcher `rank_command` uses for a script, minus the script."""
    return [sys.executable, "-m", "flodld.launcher.rank", WARM_FLAG]


def warm_handoff_argv(argv: Sequence[str]) -> list[str] | None:
    """What a warm rank is handed for the rank command `argv` (the script and its arguments), or None
    when `argv` is not this interpreter's `-m flodld.launcher.rank SCRIPT.py ...` (no warm rank fits).
    """
    head = [sys.executable, "-m", "flodld.launcher.rank"]
    if len(argv) > len(head) and list(argv[: len(head)]) == head and argv[len(head)] != WARM_FLAG:
        return list(argv[len(head) :])
    return None


def warm_environment(parent: Mapping[str, str], *, local_world_size: int) -> dict[str, str]:
    """What a warm rank starts with: the environment a CPU rank of this host will have, minus what only
    the formed world knows (identity, salt, store; handed over later). The start-up variables
    (flodld.rank.warm.startup_variables) are those of such a rank, so the hand-off can keep it.
    """
    env = base_environment(parent)
    for name in (*TORCHRUN_VARIABLES, rank_env.SALT, rank_env.RANK, rank_env.CONTROLLER):
        env.pop(name, None)
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, local_world_size))))
    return env


AGENT_STORE_HOST = "127.0.0.1"


def torchrun_environment(envelope: WorldEnvelope, *, local_rank: int, store_port: int,
                         node: tuple[int, int] | None = None) -> dict[str, str]:  # fmt: skip
    """What torchrun gives a worker, so a stock `init_process_group()` (env://) works unchanged.

    MASTER_ADDR:MASTER_PORT is the agent's loopback TCPStore endpoint (flodld.agent.tcpstore), which
    answers from the controller's authenticated store; TORCHELASTIC_USE_AGENT_STORE=True makes every
    rank, rank 0 included, a client of it (torch then starts no store server of its own). GROUP_RANK and
    GROUP_WORLD_SIZE are `node` (this host's index among the hosts, and their number: the agents work it
    out in the store, flodld.agent.tcpstore.node_rank), or (0, 1) when this host holds the whole world;
    left out when neither is known.
    """
    env = {
        "MASTER_ADDR": AGENT_STORE_HOST,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": envelope.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(envelope.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(envelope.max_restarts),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(envelope.ranks[local_rank]),
        "ROLE_WORLD_SIZE": str(envelope.world_size),
    }
    if node is None and envelope.local_world_size == envelope.world_size:
        node = (0, 1)
    if node is not None:
        env.update(GROUP_RANK=str(node[0]), GROUP_WORLD_SIZE=str(node[1]))
    return env


TORCHRUN_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)


def base_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment without any role variable (a child gets exactly one role)."""
    return {name: value for name, value in parent.items() if name not in ROLE_VARIABLES}


def rank_environment(
    parent: Mapping[str, str],
    envelope: WorldEnvelope,
    *,
    local_rank: int,
    device: str,
    salt: bytes,
    host: str,
    relay_port: int | None,
    fold: str,
    cadence: int,
    host_env: Mapping[str, str] | None = None,
    store_port: int | None = None,
    node: tuple[int, int] | None = None,
    walk_in: bool = False,
) -> dict[str, str]:
    """What a rank sees: torchrun-style identity, the controller's address, the salt, its device.

    Precedence: the agent's own environment, then the run's `env` (the controller's cluster scope),
    then `host_env` (this worker's `env:` and `nccl_socket_ifname`, which override the cluster scope),
    then the identity variables flodld sets per rank (with `store_port`, torchrun's as well: see
    `torchrun_environment`; without it, none of torchrun's rendezvous variables leak through).
    """
    env = base_environment(parent)
    env.update(envelope.env)
    env.update(host_env or {})
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    if store_port is not None:
        env.update(torchrun_environment(envelope, local_rank=local_rank, store_port=store_port, node=node))
    env.update(
        {
            rank_env.RANK: str(envelope.ranks[local_rank]),
            rank_env.WORLD_SIZE: str(envelope.world_size),
            rank_env.LOCAL_RANK: str(local_rank),
            rank_env.LOCAL_WORLD_SIZE: str(envelope.local_world_size),
            rank_env.CONTROLLER: f"{envelope.controller_host}:{envelope.controller_port}",
            rank_env.RUN_ID: envelope.run_id,
            rank_env.SALT: salt.hex(),
            rank_env.DEVICE: device,
            rank_env.BACKEND: envelope.backend,
            rank_env.AVERAGING: envelope.averaging,
            rank_env.FOLD: fold,
            rank_env.CADENCE: str(cadence),
            rank_env.HOST_NAME: host,
        }
    )
    if relay_port is not None:
        env[rank_env.RELAY_PORT] = str(relay_port)
    else:
        env.pop(rank_env.RELAY_PORT, None)
    if walk_in:  # it entered a training run: its first deposit waits for the averaged state
        env[rank_env.WALK_IN] = "1"
    else:
        env.pop(rank_env.WALK_IN, None)
    if device.startswith("cuda:"):
        # The agent's torch numbered its devices in the order (and within the visible set) it inherited.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env["CUDA_VISIBLE_DEVICES"] = visible_device_entry(parent, int(device.split(":", 1)[1]))
    else:
        cores = os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // envelope.local_world_size)))
    return env


def visible_device_entry(parent: Mapping[str, str], index: int) -> str:
    """The CUDA_VISIBLE_DEVICES value that shows a child exactly the agent's torch device `index`.

    torch numbers devices within the set the agent inherited: under CUDA_VISIBLE_DEVICES="2,3",
    cuda:0 is physical device 2 (or whatever UUID/MIG entry is listed first). Without an inherited
    list the index is the device itself. Like CUDA, the list ends at its first empty entry.
    """
    inherited = parent.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return str(index)
    entries: list[str] = []
    for part in inherited.split(","):
        entry = part.strip()
        if not entry:
            break
        entries.append(entry)
    if not 0 <= index < len(entries):
        raise ValueError(
            f"cuda:{index} is not among the {len(entries)} device(s) this agent inherited "
            f"(CUDA_VISIBLE_DEVICES={inherited!r})"
        )
    return entries[index]


def relay_environment(parent: Mapping[str, str], spec: RelayRoleSpec) -> dict[str, str]:
    """The relay's environment: its role spec, no rank identity or salt, and the CPU ranks' thread count
    (the fold's torch shares the host's cores with them; the same start-up variables as the host's fork
    server, which can then fork the relay too).
    """
    env = base_environment(parent)
    for name in (rank_env.RANK, rank_env.CONTROLLER, rank_env.SALT):
        env.pop(name, None)
    env[RELAY_ENV] = encode_spec(spec)
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, len(spec.ranks)))))
    return env


def bind_relay_listener() -> socket.socket:
    """The ranks' loopback door to the relay, bound by the agent so its port is known up front."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    listener.set_inheritable(True)
    return listener


def relay_spec_for(
    formed: WorldFormed, *, host: str, salt: bytes, host_key: bytes, listen_fd: int
) -> RelayRoleSpec:
    envelope = formed.envelope
    assert formed.relay is not None
    return RelayRoleSpec(
        host=host,
        controller_host=envelope.controller_host,
        controller_port=formed.relay.data_port,
        salt_hex=salt.hex(),
        host_key_hex=host_key.hex(),
        ranks=list(envelope.ranks),
        listen_fd=listen_fd,
        straggler_timeout=formed.relay.straggler_timeout,
        walk_in=formed.relay.walk_in,
    )


def die_with_parent() -> None:
    """In a child (before exec, or after a fork server's fork): SIGKILL when its parent dies, so no rank
    outlives its supervisor.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


async def spawn_child(
    argv: Sequence[str], env: Mapping[str, str], *, pass_fds: Sequence[int] = (), split_stderr: bool = False
) -> asyncio.subprocess.Process:
    """Start a child in its own process group (so teardown reaches its whole tree), output piped: stderr
    into the same pipe as stdout, or (`split_stderr`, for per-rank log files) a pipe of its own.
    """
    return await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE if split_stderr else asyncio.subprocess.STDOUT,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )


async def spawn_warm(env: Mapping[str, str]) -> asyncio.subprocess.Process:
    """Start a warm rank like `spawn_child` starts a rank, with its stdin a pipe for the hand-off."""
    return await asyncio.create_subprocess_exec(
        *warm_rank_command(),
        env=dict(env),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )


def signal_group(process: ChildProcess, signum: int) -> None:
    """Send `signum` to the child's process group; a group already gone is fine."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
