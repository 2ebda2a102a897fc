"""``python -m fhelium.native``: build (or load) the native extension now and say which level runs.

``make venv`` runs it once so that set-up compiles the kernels; a failure only warns (the engine
then runs the pure-torch path) unless FHELIUM_REQUIRE_NATIVE=1.
"""

from __future__ import annotations

import sys
import time

from fhelium import native


def main() -> int:
    started = time.perf_counter()
    available = native.load()
    seconds = time.perf_counter() - started
    if not available:
        print("fhelium native kernels: unavailable, the pure-torch path will run", file=sys.stderr)
        return 1
    print(
        f"fhelium native kernels: ready in {seconds:.1f} s at {native.build_directory()} "
        f"(levels {', '.join(native.supported_levels())}; running {native.level()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
