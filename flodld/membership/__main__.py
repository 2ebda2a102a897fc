"""`python -m flodld.membership PATH`: write the state.json schema (docs/state-schema.json) to PATH."""

from __future__ import annotations

import sys
from pathlib import Path

from flodld.membership.snapshot import render_state_schema


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m flodld.membership PATH  (writes the state.json JSON schema)", file=sys.stderr)
        return 2
    Path(argv[0]).write_text(render_state_schema(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
