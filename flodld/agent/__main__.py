"""`python -m flodld.agent`: the agent role as flodld's own process (its spec in FLODL_INTERNAL_AGENT_JSON).

Launchers (`fdl run`, `fdl join`, the fan-out) start this, with the user's program in the spec's
`program`: the agent starts it once per rank and never runs it itself.
"""

from __future__ import annotations

if __name__ == "__main__":
    from flodld.agent.host import run_agent
    from flodld.config.rolespec import run_role

    run_role("agent", run_agent)
