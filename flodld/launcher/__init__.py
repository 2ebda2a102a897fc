"""Role dispatch: which role (agent, relay, rank, plain) a process plays, from its environment.

The launchers start agents as flodld's own process (`python -m flodld.agent`) and agents start their
relay the same way (`python -m flodld.launcher`), so a user program only ever runs as a rank (or
plainly). There `exit_if_worker_role()` is a harmless no-op that only claims the session salt; it
still runs the agent or relay role for a program started the older way, as the agent itself (an
agent spec without `program`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum

from flodld.agent.spec import AGENT_ENV
from flodld.config.rolespec import run_role
from flodld.rank.env import claim_salt, in_flodld_rank
from flodld.relay.spec import RELAY_ENV


class Role(Enum):
    PLAIN = "plain"
    AGENT = "agent"
    RELAY = "relay"
    RANK = "rank"


class RoleError(RuntimeError):
    """The environment names more than one role."""


def current_role(environ: Mapping[str, str] | None = None) -> Role:
    env = os.environ if environ is None else environ
    agent, relay, rank = AGENT_ENV in env, RELAY_ENV in env, in_flodld_rank(env)
    if agent + relay + rank > 1:
        raise RoleError(
            f"flodld: inconsistent role environment ({AGENT_ENV}={'set' if agent else 'unset'}, "
            f"{RELAY_ENV}={'set' if relay else 'unset'}, rank={'yes' if rank else 'no'}); a process plays "
            "one role — unset the stray variables (they leak when a flodld child starts another flodld "
            "program)"
        )
    if agent:
        return Role.AGENT
    if relay:
        return Role.RELAY
    return Role.RANK if rank else Role.PLAIN


def exit_if_worker_role() -> None:
    """Run the agent or relay role and exit when this process is one; return otherwise.

    In a rank it takes the session salt out of the environment first, so that no subprocess of the
    training program inherits it (flodld.rank.env.claim_salt).
    """
    role = current_role()
    if role is Role.RANK:
        claim_salt()
    elif role is Role.AGENT:
        from flodld.agent.host import run_agent  # only in that role: `import flodld` stays light

        run_role("agent", run_agent)
    elif role is Role.RELAY:
        from flodld.relay.server import run_relay  # only in that role: `import flodld` stays light

        run_role("relay", run_relay)
