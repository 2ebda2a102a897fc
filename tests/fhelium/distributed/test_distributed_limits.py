"""Hostile descriptors and allocation failures in a real world of three ranks (gloo, 127.0.0.1).

Regression tests of issue 13: point 10 (a zero-element tensor with huge extents is a clean,
group-wide descriptor refusal, not a stride-overflow RuntimeError on the receiver while its
peers wait) and point 11 (a total cap on what one rank receives in a collective, and receive
allocation failures raised on every rank instead of hanging the peers). Every scenario ends
with honest collectives, so a pass also shows the group stayed in step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank_harness import WorldRun, run_world

pytestmark = pytest.mark.multiproc

SIZE = 3
_world: list[WorldRun] = []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> WorldRun:
    if not _world:
        workdir: Path = tmp_path_factory.mktemp("limits")
        # A short process-group timeout: a rank left waiting for a peer fails fast, not never.
        _world.append(run_world(SIZE, "limits", workdir, timeout_s=100, pg_timeout_s=10))
    run = _world[0]
    assert run.exit_codes == [0] * SIZE, "a rank did not exit cleanly:\n" + run.log_tail()
    return run


def _same_everywhere(world: WorldRun, scenario: str) -> dict[str, str]:
    per_rank = world.assert_ok(scenario)
    assert all(messages == per_rank[0] for messages in per_rank), f"ranks raised different errors: {per_rank}"
    first: dict[str, str] = per_rank[0]
    return first


def test_zero_element_descriptor_with_huge_extents_is_refused_on_every_rank(world: WorldRun) -> None:
    messages = _same_everywhere(world, "zero_element_descriptor")
    for operation in ("gather", "broadcast"):
        text = messages[operation]
        assert "argument validation failed: tensor 'data' of shape [2, 0, 1099511627775" in text, text
        assert "spans over the 68719476736-byte cap" in text, text
        assert "zero extents counted as one" in text and "Stride" not in text, text


def test_gather_total_across_ranks_is_capped(world: WorldRun) -> None:
    text = _same_everywhere(world, "gather_total_cap")["gather"]
    assert "dst (global rank 0), receiving 2 values, would allocate" in text, text
    assert "in total to receive" in text and "cap on one collective" in text, text


def test_all_gather_total_is_capped(world: WorldRun) -> None:
    text = _same_everywhere(world, "all_gather_total_cap")["all_gather"]
    assert "every rank, receiving 3 values, would allocate 2304 bytes" in text, text


def test_receive_allocation_failure_raises_on_every_rank_instead_of_hanging(world: WorldRun) -> None:
    messages = _same_everywhere(world, "allocation_failure")
    failing = {"gather": 0, "broadcast": 2, "all_gather": 1}
    for operation, rank in failing.items():
        text = messages[operation]
        assert f"global rank {rank}): cannot allocate receive storage" in text, text
        assert "can't allocate memory" in text or "out of memory" in text.lower(), text
    for operation in ("gather", "broadcast"):
        assert "receive allocation failed" in messages[operation], messages[operation]
    for seconds in (r["seconds"] for r in world.scenario("allocation_failure")):
        assert seconds < 10, "a rank waited for a peer (process-group timeout is 10 s)"
