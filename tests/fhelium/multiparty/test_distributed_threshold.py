"""The threshold protocol over a real gloo world of 2, 3 and 5 rank processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multiproc

RANK = Path(__file__).with_name("threshold_rank.py")
REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(world: int, scenario: str, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    port = _free_port()
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(
            [sys.executable, str(RANK), scenario, str(timeout_s)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ))
    results = []
    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise AssertionError(f"rank {rank} of {world} never finished (scenario {scenario})") from None
        lines = [line for line in output.splitlines() if line.startswith("{")]
        assert lines, f"rank {rank} printed no result:\n{output[-3000:]}"
        results.append(json.loads(lines[-1]))
    return results


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_decrypts_the_mean(world: int) -> None:
    results = run_world(world, "mean")
    for result in results:
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result


@pytest.mark.parametrize("world", [1, 2, 3, 5])  # 1: the blocking fallback (one sum of each, one decoder)
def test_every_rank_gets_the_mean_from_the_fused_aggregate(world: int) -> None:
    results = run_world(world, "aggregate")
    for result in results:
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        # five rows, one slice per rank: each rank encrypted and c1-summed every slice, published its
        # c0_i + h_i for every slice, and received (and decoded) the summed shares of its own only
        records = result["records"]
        assert records.count("ciphertext") == records.count("decryption_share") == world, records
        assert records.count("decryption_sum") == 1, records


def test_the_fused_aggregate_over_a_channel_without_async_sums_has_every_rank_decode_every_row() -> None:
    for result in run_world(3, "aggregate-blocking"):
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        records = result["records"]  # one ciphertext, one c1 sum, one contribution, the whole summed rows
        assert [records.count(name) for name in ("ciphertext", "c1_sum", "decryption_share")] == [1, 1, 1]
        assert records.count("decryption_sum") == 1, records


def _assert_the_others_name_the_missing_share(results: list[dict[str, Any]], leaver: int) -> None:
    """Every rank but the leaver fails with MissingSharesError naming it, within the 5 s share timeout."""
    for rank, result in enumerate(results):
        if rank == leaver:
            continue
        assert not result["ok"] and result["error"] == "MissingSharesError", result
        assert f"rank(s) [{leaver}] published none within 5s" in result["message"]
        assert f"N-out-of-N decryption needs a decryption share from each of {len(results)} ranks" in result[
            "message"
        ]
        assert result["seconds"] < 60


def test_a_rank_that_leaves_before_its_fused_share_fails_every_other_rank_naming_it() -> None:
    world, leaver, timeout_s = 3, 1, 5.0
    results = run_world(world, f"aggregate-leave:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    _assert_the_others_name_the_missing_share(results, leaver)


@pytest.mark.parametrize("world", [1, 3])  # 1: the blocking fallback
def test_the_before_contribution_hook_runs_once_after_every_c1_sum_and_before_any_contribution(
    world: int,
) -> None:
    for result in run_world(world, "aggregate-hook"):
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        records = result["records"]
        assert records.count("before_contribution") == 1, records
        hook = records.index("before_contribution")
        assert records[:hook].count("c1_sum") == records.count("c1_sum") >= 1, records
        assert "decryption_share" not in records[:hook], records


def test_a_rank_leaving_in_the_before_contribution_hook_fails_every_other_rank_naming_it() -> None:
    world, leaver, timeout_s = 3, 2, 5.0
    results = run_world(world, f"aggregate-hook:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    assert results[leaver]["records"].count("c1_sum") == world  # it had every c1 sum, published no share
    assert "decryption_share" not in results[leaver]["records"]
    _assert_the_others_name_the_missing_share(results, leaver)


def test_a_rank_that_leaves_after_encrypting_fails_every_other_rank_naming_it() -> None:
    world, leaver, timeout_s = 3, 2, 5.0
    results = run_world(world, f"leave:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    for rank in range(world):
        if rank == leaver:
            continue
        result = results[rank]
        assert not result["ok"] and result["error"] == "MissingSharesError", result
        assert f"rank(s) [{leaver}] published none within 5s" in result["message"]
        assert "N-out-of-N decryption needs a decryption share from each of 3 ranks" in result["message"]
        assert result["seconds"] < 60  # bounded: the timeout, not gloo's or forever


def test_a_rank_with_another_share_shape_is_named_before_any_payload_moves() -> None:
    results = run_world(3, "shape:1", timeout_s=20.0)
    for rank, result in enumerate(results):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert "'decryption-shares' exchange was refused before any payload moved" in result["message"]
        named = "[0, 2]" if rank == 1 else "[1]"
        assert f"rank(s) {named} describe another payload" in result["message"], result["message"]


def test_a_rank_summing_another_key_share_than_it_committed_to_is_refused_on_every_rank() -> None:
    # The rogue-key attack: the last hop of a ring all-reduce sees the others' partial sum and could
    # steer the collective key; the committed shares, opened after the sum, no longer add up to it.
    for result in run_world(3, "rogue-sum:2"):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert (
            "the summed key shares differ from the sum of the committed, opened shares" in result["message"]
        )


def test_a_rank_opening_another_key_share_than_it_committed_to_is_named() -> None:
    for result in run_world(3, "rogue-open:1"):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert "rank(s) [1] opened a key share that does not match the commitment" in result["message"]
