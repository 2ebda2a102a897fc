"""`python -m flodld.launcher`: run the worker role the environment names (agent or relay), then exit.

The agent starts its relay this way, so the relay never runs the user's program either.
"""

from __future__ import annotations

import sys

from flodld.launcher import exit_if_worker_role

if __name__ == "__main__":
    exit_if_worker_role()
    sys.stderr.write("flodld.launcher: no agent or relay role in the environment; nothing to run\n")
    sys.exit(2)
