"""The encrypted-mean workload as other suites run it (e.g. tests/hosts for the tunnel-only run).

from tests.flagship.workload import ENCRYPTED_MEAN, encrypted_mean_args, assert_encrypted_mean_passed
launcher = _fanout(lab, cluster, str(ENCRYPTED_MEAN), *encrypted_mean_args())
assert_encrypted_mean_passed(output, world_size=4, transport="relay")
"""

from __future__ import annotations

import re
from pathlib import Path

ENCRYPTED_MEAN = Path(__file__).resolve().parents[2] / "examples" / "encrypted_mean.py"
# One ciphertext of the aggregation ring (N = 2^13 holds 4096 slots): seconds, not minutes.
SMALL_VALUES = 4096


def encrypted_mean_args(values: int = SMALL_VALUES, *, transport: str = "relay") -> list[str]:
    """Program arguments: the relay path is the one that rides SSH tunnels (no rank-to-rank traffic)."""
    return ["--values", str(values), "--transport", transport]


def assert_encrypted_mean_passed(output: str, world_size: int, *, transport: str = "relay") -> list[float]:
    """Every rank printed a PASS verdict for this world and transport; returns the measured errors."""
    verdicts = re.findall(
        rf"encrypted_mean rank (\d+)/{world_size}: encrypted mean PASS: max error (\S+) .* transport "
        rf"{transport} ",
        output,
    )
    ranks = sorted(int(rank) for rank, _ in verdicts)
    assert ranks == list(range(world_size)), (
        f"PASS verdicts from ranks {ranks} of {world_size}:\n{output[-4000:]}"
    )
    return [float(error) for _, error in verdicts]
