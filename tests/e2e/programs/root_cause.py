"""A stock torchrun script whose rank 1 raises while every other rank blocks in a collective.

`@record` (torch.distributed.elastic) writes rank 1's exception to its TORCHELASTIC_ERROR_FILE, as under
torchrun; with `--no-record` the script is left undecorated (only the traceback tells). Rank 1 prints a
secret from its environment first: the root cause's tail must scrub it.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is up
    if rank == 1:
        print(f"rank 1 about to fail; token {os.environ['ROOT_CAUSE_TEST_TOKEN']}", flush=True)
        raise RuntimeError(f"rank 1 fails on purpose (token {os.environ['ROOT_CAUSE_TEST_TOKEN']})")
    dist.all_reduce(t)  # blocks: rank 1 never joins it
    print(f"rank {rank} finished a collective without rank 1", flush=True)


if __name__ == "__main__":
    (main if "--no-record" in sys.argv else record(main))()
