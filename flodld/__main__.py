"""`python -m flodld` / the `flodld` console script: the controller daemon (see flodld.controller.daemon)."""

from __future__ import annotations

import sys


def main() -> int:
    from flodld.controller.daemon import main as daemon_main

    return daemon_main()


if __name__ == "__main__":
    sys.exit(main())
