"""A stock torchrun script: no flodld import, env:// rendezvous, gloo. Runs as is under torchrun,
`fdl run` and `fdl join --bin`.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

# Top level: under flodld this runs in ranks only (never in an agent or relay, which are flodld's own).
print(
    f"stock top-level RANK={os.environ.get('RANK')} MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
    f"salt_in_env={'FLODL_INTERNAL_SALT' in os.environ} argv0={os.path.basename(sys.argv[0])} "
    f"name={__name__}",
    flush=True,
)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if len(sys.argv) > 1:  # a long step: the run must outlive the controller's startup grace
        time.sleep(float(sys.argv[1]))
    pair = dist.new_group([0, 1])
    p = torch.tensor([float(rank + 1)])
    if rank in (0, 1):
        dist.all_reduce(p, group=pair)
    dist.barrier()
    print(
        f"stock rank={rank}/{world} local={local[0]}/{local[1]} sum={t.item():g} pair={p.item():g} "
        f"group={os.environ.get('GROUP_RANK')}/{os.environ.get('GROUP_WORLD_SIZE')}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
