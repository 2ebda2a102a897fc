"""`flodld.run` leaves no process group behind a rank, whether `main` returns or raises.

Left to interpreter shutdown, gloo's teardown raced the peers' exits and aborted ranks (SIGABRT)
after their work was done; CI caught it as a rank 'exited with signal 6' after PASS.
"""

from __future__ import annotations

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
