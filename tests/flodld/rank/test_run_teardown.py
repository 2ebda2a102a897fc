"""`flodld.run` leaves no process group behind a rank, whether `main` returns or raises.

Left to interpreter shutdown, gloo's teardown raced the peers' exits and aborted ranks (SIGABRT)
after their work was done; CI caught it as a rank 'exited with signal 6' after PASS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

import flodld


@pytest.fixture
def rank_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_CONTROLLER", "127.0.0.1:1")
    monkeypatch.setenv("RANK", "0")


def open_world_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]


def test_a_rank_whose_main_returns_has_its_group_destroyed(rank_role: None) -> None:
    def main() -> int:
        open_world_of_one()
        assert dist.is_initialized()
        return 0

    assert flodld.run(main, init_process_group=False) == 0
    assert not dist.is_initialized()


def test_a_rank_whose_main_raises_has_its_group_destroyed_and_the_error_kept(rank_role: None) -> None:
    def main() -> int:
        open_world_of_one()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        flodld.run(main, init_process_group=False)
    assert not dist.is_initialized()


def test_a_plain_process_keeps_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLODL_CONTROLLER", raising=False)

    def main() -> int:
        open_world_of_one()
        return 0

    try:
        assert flodld.run(main, init_process_group=False) == 0
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


RETAINED_GROUP = """
import torch, torch.distributed as dist
from flodld.rank.process_group import _gloo_worker_states, quiesce_gloo_workers
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import torch.distributed.nn  # captures group.WORLD in default arguments: torch keeps the group alive
for _ in range(32):
    dist.all_gather([torch.empty(1 << 12)], torch.ones(1 << 12), async_op=True)
dist.barrier()
dist.destroy_process_group()
workers = _gloo_worker_states()
assert workers, "torch no longer keeps the group alive; this test needs another way to keep gloo workers"
assert quiesce_gloo_workers(limit_s=10.0) is True
assert all(state in "SI" for state in _gloo_worker_states()), _gloo_worker_states()
print("quiet", len(workers))
"""


def test_gloo_workers_of_a_group_torch_keeps_alive_are_quiet_before_the_interpreter_exits() -> None:
    """A group that torch itself keeps past `destroy_process_group` keeps its gloo workers; the teardown
    waits until none is runnable, so none is left freeing a work (and taking the GIL) during shutdown,
    which aborted a rank after `checkpoint ok` in CI (SIGABRT, 'terminate called without an active
    exception').
    """
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RETAINED_GROUP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("quiet "), done.stdout


def test_the_rank_launcher_settles_torch_distributed_at_exit(tmp_path: Path) -> None:
    """A stock script that leaves its group open exits through the launcher with the group destroyed and
    gloo's workers quiet, after the script's own atexit handlers (which may still use the group).
    """
    import subprocess
    import sys


    script = tmp_path / "leaves_group_open.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "def last_words():\n"
        "    t = torch.ones(2); dist.all_reduce(t); print('atexit used the group', t.tolist(), flush=True)\n"
        "atexit.register(last_words)\n"
        "import flodld.rank.process_group as pg\n"
        "real = pg.close_process_group\n"
        "def traced():\n"
        "    print('settle: initialized', dist.is_initialized(), flush=True); real()\n"
        "    print('settle: after', dist.is_initialized(), pg._gloo_worker_states(), flush=True)\n"
        "pg.close_process_group = traced\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "flodld.launcher.rank", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines == [
        "atexit used the group [1.0, 1.0]",
        "settle: initialized True",
        "settle: after False []",
    ], lines


def test_the_rank_launcher_finalizes_cyclic_garbage_then_freezes_the_rest(tmp_path: Path) -> None:
    """The launcher's last atexit handler collects once (a script's cyclic garbage still has its `__del__`
    run, with the interpreter whole) and freezes what is left, so the interpreter's own shutdown does not
    walk it again: an object freed while the modules are torn down sees the freeze.
    """
    import subprocess
    import sys

    out = tmp_path / "written.txt"
    script = tmp_path / "cyclic_garbage_at_exit.py"
    script.write_text(
        "import gc, sys, types\n"
        "class Node:\n"
        "    def __init__(self): self.me, self.open, self.path = self, open, sys.argv[1]\n"
        "    def __del__(self):\n"
        "        with self.open(self.path, 'w') as f: f.write('finalized')\n"
        "class Witness:  # freed with its module at shutdown, after every atexit handler\n"
        "    def __init__(self):\n"
        "        self.gc, self.out, self.open, self.path = gc, sys.stdout, open, sys.argv[1]\n"
        "    def __del__(self):\n"
        "        with self.open(self.path) as f: text = f.read()\n"
        "        self.out.write(f'at shutdown: frozen {self.gc.get_freeze_count() > 0}, file {text}\\n')\n"
        "keeper = types.ModuleType('witness_keeper'); keeper.witness = Witness()\n"
        "sys.modules['witness_keeper'] = keeper\n"
        "Node()  # garbage in a reference cycle: only a collection finalizes it\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "flodld.launcher.rank", str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["at shutdown: frozen True, file finalized"], done.stdout
