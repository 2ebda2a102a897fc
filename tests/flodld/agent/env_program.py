"""A rank that reports the environment it was started with (names in FLODL_TEST_REPORT_ENV) and exits.

It also reports whether a subprocess of the training program inherits the session salt
(CHILD-SALT), and whether the rank itself can still read it (RANK-SALT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flodld
from flodld.rank.env import SALT, read_rank_environment


def main() -> int:
    names = os.environ.get("FLODL_TEST_REPORT_ENV", "").split(",")
    print("RANK-ENV " + json.dumps({name: os.environ.get(name) for name in names if name}), flush=True)
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({SALT!r}, ''))"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    print("CHILD-SALT " + json.dumps(child.stdout.strip()), flush=True)
    print("RANK-SALT " + json.dumps(read_rank_environment().salt.hex()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
