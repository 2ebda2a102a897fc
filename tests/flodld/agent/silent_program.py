"""A training program whose ranks never talk to the controller.

Only the agent's join link can notice it die.
"""

from __future__ import annotations

import sys
import time

import flodld


def main() -> int:
    print("silent-rank ready", flush=True)
    time.sleep(120)
    print("silent-rank outlived its controller", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(flodld.run(main, init_process_group=False))
