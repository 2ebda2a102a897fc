"""torchrun parity across two "real hosts" (network namespaces, fan-out over SSH, 2 gloo CPU ranks each):
a stock torchrun script (env:// through each host's agent TCPStore endpoint, no flodld import) and the
process-group feature rows of tests/e2e/programs/torchrun_features.py (issue 20, goals 2 and 3).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.hosts.netns import Lab
from tests.hosts.test_multi_host import _assert_no_process_left, _cluster, _fanout, _wait
from tests.hosts.test_multi_host import lab as lab  # the fixture, re-exported for pytest

pytestmark = [pytest.mark.netns, pytest.mark.sshd, pytest.mark.multiproc]
PROGRAMS = Path(__file__).resolve().parents[1] / "e2e" / "programs"


@pytest.mark.timeout(300)
def test_a_stock_torchrun_script_runs_as_is_on_two_hosts(lab: Lab) -> None:
    program = lab.root / "stock_two_hosts.py"
    shutil.copy(PROGRAMS / "torchrun_stock.py", program)
    launcher = _fanout(lab, _cluster(lab, tunnel=False), program)
    log = _wait(launcher, lab.root / "launcher.log", 240)
    assert launcher.returncode == 0, log[-6000:]
    lines = sorted(re.findall(r"stock rank=(\d)/4 local=\d/2 sum=10 pair=\d group=(\S+)", log))
    # GROUP_RANK as torchrun sets it: the node index, hosts ordered by their ranks.
    assert lines == [("0", "0/2"), ("1", "0/2"), ("2", "1/2"), ("3", "1/2")], log[-6000:]
    assert "[node-1]" in log and "[node-2]" in log
    _assert_no_process_left(str(program))


@pytest.mark.timeout(300)
def test_the_process_group_features_work_across_two_hosts(lab: Lab) -> None:
    """fsdp2_hsdp, tensor_parallel, object_collectives and checkpoint, one after another in one world of
    4 ranks on two hosts (the program's row `every`, which runs them with the other rows but pipelining).
    """
    program = lab.root / "features_two_hosts.py"
    shutil.copy(PROGRAMS / "torchrun_features.py", program)
    launcher = _fanout(lab, _cluster(lab, tunnel=False), program, "every", str(lab.root / "checkpoint"))
    log = _wait(launcher, lab.root / "launcher.log", 240)
    assert launcher.returncode == 0, log[-6000:]
    for row in ("fsdp2_hsdp", "tensor_parallel", "object_collectives", "checkpoint"):
        assert sorted(re.findall(rf"{row} ok rank=(\d)", log)) == ["0", "1", "2", "3"], (row, log[-6000:])
    _assert_no_process_left(str(program))
