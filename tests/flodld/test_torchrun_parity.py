"""torchrun parity under `fdl run` (issue 20): process-group features that build their own groups and use
the rendezvous store the way torch's internals do, at 4 gloo ranks on loopback.

`new_group` and a 2-D `init_device_mesh` construct new `ProcessGroupGloo`s over (clones of) the
controller store; before the store kept its Python objects alive and implemented `clone`, they failed with
"fn INTERNAL ASSERT FAILED ... Not implemented" / "pure virtual function ::c10d::Store::clone".
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.e2e.harness import Fdl

pytestmark = pytest.mark.multiproc

_PROGRAM = textwrap.dedent(
    """
    import sys
    from datetime import timedelta

    from flodld.launcher import exit_if_worker_role

    exit_if_worker_role()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import flodld


    def main() -> int:
        torch.set_num_threads(1)
        rank, world = dist.get_rank(), dist.get_world_size()
        pair = dist.new_group([0, 1])
        if rank in (0, 1):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=pair)
            print(f"new_group rank={rank} sum={t.item():g}", flush=True)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = torch.tensor([float(rank)]), torch.tensor([float(rank)])
        dist.all_reduce(dp, group=mesh.get_group("dp"))
        dist.all_reduce(tp, group=mesh.get_group("tp"))
        print(f"mesh rank={rank}/{world} dp={dp.item():g} tp={tp.item():g}", flush=True)
        store = dist.distributed_c10d._get_default_store()
        clone = store.clone()
        clone.set(f"clone/{rank}", str(rank))
        try:
            store.wait([f"never/{rank}"], timedelta(seconds=0.2))
        except dist.DistStoreError as error:
            print(f"store timeout rank={rank} runtime={isinstance(error, RuntimeError)} "
                  f"named={'200ms' in str(error)}", flush=True)
        store.wait([f"clone/{r}" for r in range(world)])
        dist.barrier()
        return 0


    if __name__ == "__main__":
        sys.exit(flodld.run(main))
    """
)


def test_new_group_and_a_2d_device_mesh_work_under_fdl_run_at_4_ranks(tmp_path: Path) -> None:
    program = tmp_path / "mesh.py"
    program.write_text(_PROGRAM)
    run = Fdl("run", "--ranks", "4", str(program))
    assert run.wait(240) == 0, run.output[-6000:]
    assert sorted(re.findall(r"new_group rank=(\d) sum=3\b", run.output)) == ["0", "1"], run.output[-6000:]
    # (2, 2) mesh: rows [0, 1] and [2, 3]; "dp" groups {0, 2}, {1, 3}; "tp" groups {0, 1}, {2, 3}.
    meshes = {int(r): (dp, tp) for r, dp, tp in re.findall(r"mesh rank=(\d)/4 dp=(\d+) tp=(\d+)", run.output)}
    assert meshes == {0: ("2", "1"), 1: ("4", "1"), 2: ("2", "5"), 3: ("4", "5")}, run.output[-6000:]
    timeouts = re.findall(r"store timeout rank=\d runtime=True named=True", run.output)
    assert len(timeouts) == 4, run.output[-6000:]
    assert "fdl run: run done" in run.output


@pytest.mark.timeout(180)
def test_the_user_guides_flodld_program_runs_under_a_real_torchrun_at_2_ranks(tmp_path: Path) -> None:
    # "a flodld.run(main) script started by torchrun": flodld.run joins torchrun's world through env://.
    import shutil
    import subprocess
    import sys

    from tests.flodld.test_run_world_of_one import guide_example, plain_env

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None, "torchrun is installed with torch"
    script = tmp_path / "train.py"
    script.write_text(guide_example())
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script)], env=plain_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d)/2: 3\.0", done.stdout)) == ["0", "1"], (
        done.stdout + done.stderr[-3000:]
    )


_BACKEND_PROGRAM = textwrap.dedent(
    """
    from datetime import timedelta

    import torch.distributed as dist

    import flodld


    def main() -> int:
        rank = dist.get_rank()
        print(f"rank {rank} backend {dist.get_backend()}", flush=True)
        dist.monitored_barrier(timeout=timedelta(seconds=60))  # gloo only: refused under torch's default
        print(f"rank {rank} monitored_barrier ok", flush=True)
        return 0


    flodld.run(main)
    """
)


@pytest.mark.timeout(300)
def test_flodld_run_picks_the_same_backend_under_torchrun_and_fdl_run(tmp_path: Path) -> None:
    # Under torchrun, flodld.run used to call init_process_group without a backend (torch's
    # "cpu:gloo,cuda:nccl", reported as "undefined"), and monitored_barrier refused to run.
    import shutil
    import subprocess
    import sys

    from tests.flodld.test_run_world_of_one import plain_env

    script = tmp_path / "train.py"
    script.write_text(_BACKEND_PROGRAM)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None, "torchrun is installed with torch"
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script)], env=plain_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=150)  # fmt: skip
    output = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, output
    under_fdl = Fdl("run", "--ranks", "2", str(script), cwd=tmp_path)
    assert under_fdl.wait(150) == 0, under_fdl.output
    both = output + under_fdl.output
    for launched in (done.stdout, under_fdl.output):
        assert sorted(re.findall(r"rank (\d) backend gloo", launched)) == ["0", "1"], both
        assert sorted(re.findall(r"rank (\d) monitored_barrier ok", launched)) == ["0", "1"], both
