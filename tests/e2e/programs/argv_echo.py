"""Prints, on each rank, its argv (after the program) as JSON: `argv rank=R <json>`. Run as a file or -m."""

from __future__ import annotations

import json
import os
import sys

print(f"argv rank={os.environ.get('RANK')} {json.dumps(sys.argv[1:])}", flush=True)
