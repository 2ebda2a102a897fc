"""Writes one line to stdout and one to stderr naming its rank and attempt (`out rank=R attempt=N`,
`err rank=R attempt=N`); with `--fail-first-attempt`, rank 1 then exits 3 on attempt 0 (a restart follows).
"""

from __future__ import annotations

import os
import sys

rank, attempt = os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
print(f"out rank={rank} attempt={attempt}", flush=True)
print(f"err rank={rank} attempt={attempt}", file=sys.stderr, flush=True)
if "--fail-first-attempt" in sys.argv[1:] and rank == "1" and attempt == "0":
    sys.exit(3)
