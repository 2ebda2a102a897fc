"""Real multi-process worlds (gloo on 127.0.0.1) for world sizes 1, 2, 3 and 5.

One world is launched per size and runs every scenario of rank_scenarios.SUITES["main"]; the
tests below each check one scenario's per-rank results. Rendezvous differs per size so that
every init path is exercised: a world of one has no rendezvous at all (local HashStore), the
world of three passes an explicit store (as a flodld rank does), the others use torchrun's
environment variables.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from multirank_harness import WorldRun, run_world
from rank_scenarios import SCENARIOS, subgroup_members

pytestmark = pytest.mark.multiproc

WORLD_SIZES = [1, 2, 3, 5]
RENDEZVOUS = {1: "none", 2: "torchrun", 3: "store", 5: "torchrun"}
_worlds: dict[int, WorldRun] = {}


def world(size: int, tmp_path_factory: pytest.TempPathFactory) -> WorldRun:
    """The one world of this size for the whole module (launched on first use, even if it failed)."""
    if size not in _worlds:
        workdir: Path = tmp_path_factory.mktemp(f"world{size}")
        _worlds[size] = run_world(size, "main", workdir, timeout_s=100, rendezvous=RENDEZVOUS[size])
    run = _worlds[size]
    assert run.exit_codes == [0] * size, "a rank did not exit cleanly:\n" + run.log_tail()
    return run


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", [name for name, _ in SCENARIOS])
def test_scenario_passes_on_every_rank(
    size: int, scenario: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    world(size, tmp_path_factory).assert_ok(scenario)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_global_group_and_local_ranks_are_distinct_namespaces(
    size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    per_rank = world(size, tmp_path_factory).assert_ok("identity")
    members = subgroup_members(size)
    for rank, data in enumerate(per_rank):
        assert (data["global_rank"], data["world_size"], data["local_rank"]) == (rank, size, rank)
        assert data["device"] == "cpu" and data["backend"] == "gloo"
        assert data["default"] == {"group_rank": rank, "size": size, "global_of_group_rank_0": 0}
        if members is not None and rank in members:
            assert data["subgroup"] == {
                "group_rank": members.index(rank),
                "size": len(members),
                "global_of_group_rank_0": members[0],
            }
        else:
            assert "subgroup" not in data


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("scenario", ["broadcast_errors", "layout_mismatch"])
def test_argument_errors_are_identical_on_every_rank(
    size: int, scenario: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    per_rank = world(size, tmp_path_factory).assert_ok(scenario)
    members = subgroup_members(size)
    labels = ["default"] + (["subgroup"] if members is not None and len(members) > 1 else [])
    for label in labels:
        seen = [data[label] for data in per_rank if label in data]
        assert len(seen) == (size if label == "default" else len(members or ())), label
        assert all(messages == seen[0] for messages in seen), f"{label}: ranks raised different errors"


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_reduction_tree_sends_p_minus_one_messages_in_ceil_log2_rounds(
    size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    per_rank = world(size, tmp_path_factory).assert_ok("reductions")
    for label in ("default", "subgroup"):
        entries = [data[label] for data in per_rank if label in data]
        if not entries:
            continue
        group_size = entries[0]["size"]
        rounds = math.ceil(math.log2(group_size))
        for kind, root in (("reduce", group_size - 1), ("all_reduce", 0)):
            traces: list[dict[str, Any]] = [e[kind] for e in entries]
            assert sum(t["messages_sent"] for t in traces) == group_size - 1
            assert sum(t["messages_received"] for t in traces) == group_size - 1
            assert all(t["schedule_rounds"] == rounds for t in traces)
            assert all(t["incoming_buffers"] <= 1 for t in traces)
            assert all(t["additions"] == t["messages_received"] for t in traces)
            root_trace = next(e[kind] for e in entries if e["group_rank"] == root)
            assert root_trace["messages_received"] == rounds == root_trace["rounds_active"]
            assert max(t["rounds_active"] for t in traces) == rounds
        assert all(e["all_reduce"]["final_broadcasts"] == (1 if group_size > 1 else 0) for e in entries)
        # The SUM schedule (exact: P x 50-bit primes cannot wrap int64) is what "auto" picks here.
        for kind in ("all_reduce_sum", "all_reduce_auto"):
            expected = "sum" if group_size > 1 else "tree"
            assert all(e[kind]["algorithm"] == expected for e in entries), (kind, entries)
            assert all(e[kind]["sum_all_reduces"] == (1 if group_size > 1 else 0) for e in entries)
            assert all(e[kind]["messages_sent"] == 0 == e[kind]["additions"] for e in entries)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_raw_reduce_op_sum_wraps_instead_of_reducing_modulo_primes(
    size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for data in world(size, tmp_path_factory).assert_ok("raw_sum_is_not_modular"):
        assert data["raw"] != data["python"]
        assert data["raw"] == (data["python"] + 2**63) % 2**64 - 2**63


def test_failed_collective_times_out_with_a_diagnosis_and_ranks_exit_cleanly(tmp_path: Path) -> None:
    pg_timeout = 3.0
    run = run_world(3, "failure", tmp_path, timeout_s=90, pg_timeout_s=pg_timeout)
    assert run.exit_codes == [0, 0, 0], run.log_tail()
    per_rank = run.assert_ok("peer_skips_collective")
    for rank in (0, 1):
        message = per_rank[rank]["message"]
        assert "broadcast_ciphertext" in message and "control exchange" in message
        assert f"global rank {rank}" in message and "docs/distributed.md" in message
        assert per_rank[rank]["elapsed"] < 6 * pg_timeout
