"""Backend collectives on real gloo process groups of 1, 2 and 3 spawned ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rank_zygote import Zygote

WORKER = Path(__file__).with_name("_ir_rank_worker.py")
REPO = Path(__file__).resolve().parents[3]
MODULI = (1_000_003, 998_244_353, 754_974_721)
# what _ir_rank_worker.py imports, loaded once in the zygote its ranks are forked from (tests/rank_zygote.py)
PRELOAD = ["torch.distributed", "fhelium.distributed", "fhelium.backend", "fhelium.compile", "fhelium.ir"]


def _fake_ciphertext_data(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, q, (2, 1, 16), generator=generator) for q in MODULI], dim=1)


def spawn_world(zygote: Zygote, world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's results: WORLD ranks of _ir_rank_worker.py forked from ZYGOTE, every one exited 0."""
    init_file = tmp_path / "rendezvous"
    outputs = [tmp_path / f"rank-{rank}.json" for rank in range(world)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [str(world), str(init_file)]
    processes = [
        zygote.spawn(WORKER, [str(rank), *argv, str(out)], env, tmp_path / f"rank-{rank}.log")
        for rank, out in enumerate(outputs)
    ]
    try:
        codes = [process.wait(timeout=90) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for rank, (code, process) in enumerate(zip(codes, processes, strict=True)):
        assert code == 0, f"rank {rank} failed:\n{process.output}"
    return [json.loads(path.read_text()) for path in outputs]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    forker = Zygote(PRELOAD, {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        yield forker
    finally:
        forker.close()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda p: f"world{p}")
def world(
    request: pytest.FixtureRequest, zygote: Zygote, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    size = int(request.param)
    return size, spawn_world(zygote, size, tmp_path_factory.mktemp(f"world{size}"))


pytestmark = pytest.mark.multiproc


def test_rank_query_reads_group_relative_identity(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    assert [r["query"] for r in results] == [[rank, size] for rank in range(size)]


def test_broadcast_delivers_the_root_value_functionally(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    for result in results:
        assert result["broadcast"] == [10 * size] * 5
        assert result["broadcast_input_untouched"]


def test_visible_combine_region_folds_in_group_rank_order(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    q = torch.tensor(MODULI).view(1, -1, 1)
    expected = _fake_ciphertext_data(100)
    for rank in range(1, size):
        expected = (expected - _fake_ciphertext_data(100 + rank)) % q
    for result in results:
        assert torch.equal(torch.tensor(result["combine"]), expected)


def test_example_generic_and_specialized_all_reduce_agree(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    q = torch.tensor(MODULI).view(1, -1, 1)
    x = _fake_ciphertext_data(7)
    expected = (x * (2 * size)) % q  # every rank adds x over an interval of 2, then all ranks sum
    for result in results:
        assert result["example_specialized"] == result["example_generic"]
        assert torch.equal(torch.tensor(result["example_generic"]), expected)
        assert result["example_metadata"] == [2.0**40, [0, 1, 2]]


def test_compiled_all_reduce_takes_the_sum_schedule_where_it_is_exact(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    """The Program path's adder is a ResidueModuliAdder over the default (declared canonical) add:
    `sum` where P x max(q) fits int64, the tree where it does not or where the add implementation
    does not declare canonical modular addition; the result is the modular sum either way.
    """
    size, results = world
    big = (3_100_000_000_000_000_000, 1_000_003, 998_244_353)
    expected_schedule = {
        "declared_small": "sum" if size > 1 else "tree",  # one rank: nothing to add
        "declared_big": "sum" if size == 2 else "tree",  # 3 x 3.1e18 would wrap int64
        "undeclared_small": "tree",
    }
    for name, moduli in (("declared_small", MODULI), ("declared_big", big), ("undeclared_small", MODULI)):
        q = torch.tensor(moduli).view(1, -1, 1)
        parts = []
        for rank in range(size):
            generator = torch.Generator().manual_seed(7 + rank)
            parts.append(
                torch.cat([torch.randint(0, m, (2, 1, 16), generator=generator) for m in moduli], dim=1)
            )
        expected = parts[0]
        for part in parts[1:]:
            total = expected + part  # < 2 x 3.1e18: no wrap
            expected = torch.where(total >= q, total - q, total)
        for rank, result in enumerate(results):
            schedule = result["schedules"][name]
            assert schedule["algorithm"] == expected_schedule[name], (name, rank)
            assert torch.equal(torch.tensor(schedule["data"]), expected), (name, rank)


def test_mismatched_layouts_fail_together_in_the_control_exchange(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    size, results = world
    if size == 1:
        assert results[0]["mismatch"] is None  # nothing to compare with
        return
    errors = [result["mismatch"] for result in results]
    assert errors[0] is not None and all(error == errors[0] for error in errors)
    kind, message = errors[0]
    assert kind == "CollectiveArgumentError"
    assert "fhelium_dist.all_reduce" in message and "group rank 1" in message and "shape" in message
    assert all(result["after_mismatch_query"] == [rank, size] for rank, result in enumerate(results))


def test_subgroup_ranks_are_group_relative(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    if size != 3:
        assert not any("subgroup_query" in result for result in results)  # only run with three ranks
        return
    assert results[1]["subgroup_query"] == [0, 2] and results[2]["subgroup_query"] == [1, 2]
    assert results[1]["subgroup_broadcast"] == [30] * 5 == results[2]["subgroup_broadcast"]
    assert "subgroup_query" not in results[0]
