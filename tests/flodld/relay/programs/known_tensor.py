"""Encryption test program: torch.distributed init through the controller's store, then one CPU average
of a known tensor through the relays. The test looks for that tensor's bytes on the wire.
"""

from __future__ import annotations

from flodld.launcher import exit_if_worker_role

exit_if_worker_role()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flodld  # noqa: E402
from flodld.rank.averaging import all_average  # noqa: E402


def main() -> int:
    rank = dist.get_rank()
    (mean,) = all_average([torch.full((4096,), 1234.5 + rank, dtype=torch.float32)])
    expected = 1234.5 + (dist.get_world_size() - 1) / 2
    assert torch.equal(mean, torch.full((4096,), expected)), mean[:4]
    print(f"rank {rank}: known tensor mean ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(flodld.run(main))
