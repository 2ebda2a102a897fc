"""torchrun parity in a two-host *walk-in* world (issue 20, goal 2): a `flodld serve --once` controller in
its own network namespace, and on each of two worker hosts (namespaces) `fdl join HOST:PORT --bin SCRIPT`
with the run's token, as an operator walks workers in; no SSH anywhere. The script is the stock torchrun
feature program (env://, no flodld import): every process-group row in one world of 4 gloo CPU ranks (two
per host), and pipelining in a world of 2 (one per host).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

import pytest

from tests.hosts.netns import WORKER_IFNAME, Lab, controller_address
from tests.hosts.test_multi_host import REPO, _assert_no_process_left, _wait
from tests.hosts.test_multi_host import lab as lab  # the fixture, re-exported for pytest

pytestmark = [pytest.mark.netns, pytest.mark.sshd, pytest.mark.multiproc]
PROGRAMS = Path(__file__).resolve().parents[1] / "e2e" / "programs"
PORT = 29533
EVERY_ROW = ["ddp", "object_collectives", "monitored_barrier", "split_group", "fsdp2_hsdp", "tensor_parallel",
             "checkpoint"]  # fmt: skip


def _walk_in_world(lab: Lab, row: str, ranks_per_host: int) -> tuple[str, list[str]]:
    """Serve one run, walk both workers in, return the controller's log and each walk-in's log."""
    program = lab.root / "features_walk_in.py"
    shutil.copy(PROGRAMS / "torchrun_features.py", program)
    token = secrets.token_hex(16)
    env = {**os.environ, "FDL_JOIN_TOKEN": token, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": WORKER_IFNAME}
    world = 2 * ranks_per_host
    controller = lab.spawn(
        lab.controller_ns,
        [str(REPO / ".venv" / "bin" / "flodld"), "serve", "--once", "--bind", "0.0.0.0", "--port", str(PORT),
         "--host", controller_address(1), "--discovery", "--min-ranks", str(world), "--target", str(world),
         "--window", "120", "--token", token],
        log=lab.root / "controller.log", cwd=REPO, env={**os.environ},
    )  # fmt: skip
    lab.wait_listening(lab.controller_ns, controller_address(1), PORT)
    walkers = []
    for index in (1, 2):
        walkers.append(
            lab.spawn(
                lab.worker_ns(index),
                [str(REPO / ".venv" / "bin" / "fdl"), "join", f"{controller_address(1)}:{PORT}", "--bin",
                 str(program), "--host", f"node-{index}", "--devices", f"cpu:{ranks_per_host}", "--project",
                 str(lab.root), "--", row, str(lab.root / "checkpoint")],
                log=lab.root / f"walker{index}.log", cwd=lab.root, env=env,
            )
        )
    logs = [_wait(walker, lab.root / f"walker{i}.log", 240) for i, walker in enumerate(walkers, start=1)]
    served = _wait(controller, lab.root / "controller.log", 60)
    for walker, log in zip(walkers, logs, strict=True):
        assert walker.returncode == 0, log[-6000:]
    assert controller.returncode == 0, served[-6000:]
    _assert_no_process_left(str(program))
    return served, logs


@pytest.mark.timeout(400)
def test_every_process_group_feature_works_in_a_two_host_walk_in_world(lab: Lab) -> None:
    _, logs = _walk_in_world(lab, "every", ranks_per_host=2)
    both = "".join(logs)
    for row in EVERY_ROW:
        assert sorted(re.findall(rf"{row} ok rank=(\d)", both)) == ["0", "1", "2", "3"], (row, both[-6000:])
    # Each host's walk-in ran two of the four ranks (hosts ordered by their ranks).
    assert sorted(re.findall(r"ddp ok rank=(\d)", logs[0])) in (["0", "1"], ["2", "3"]), logs[0][-3000:]


@pytest.mark.timeout(300)
def test_pipelining_works_in_a_two_host_walk_in_world_of_two_ranks(lab: Lab) -> None:
    _, logs = _walk_in_world(lab, "pipelining", ranks_per_host=1)
    both = "".join(logs)
    assert sorted(re.findall(r"pipelining ok rank=(\d)", both)) == ["0", "1"], both[-6000:]
