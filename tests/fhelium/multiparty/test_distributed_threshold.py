"""The threshold protocol over a real gloo world of 2, 3 and 5 rank processes on 127.0.0.1."""

from __future__ import annotations

import functools
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.rank_zygote import Zygote, collect_results

pytestmark = pytest.mark.multiproc

RANK = Path(__file__).with_name("threshold_rank.py")
REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# what threshold_rank.py imports, loaded once in the zygote its ranks are forked from (tests/rank_zygote.py)
PRELOAD = [
    "torch.distributed", "fhelium.distributed", "fhelium.multiparty", "fhelium.multiparty.distributed",
    "fhelium.native.build:load",
]  # fmt: skip
WorldRunner = Callable[..., list[dict[str, Any]]]
# The share timeout of the scenarios where a rank leaves: the others wait this long for it in one exchange.
# Every rank is forked from the zygote with everything imported and passes gloo's init barrier before its
# first exchange, so a live rank is late by its compute between two exchanges (well under a second on a
# loaded 2-core box), never by an import.
LEAVE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def run_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorldRunner]:
    """`run_world(world, scenario, timeout_s=20.0)`: each rank's JSON result, ranks forked from one zygote."""
    zygote = Zygote(PRELOAD, {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        yield functools.partial(_run_world, zygote, tmp_path_factory.mktemp("threshold-ranks"))
    finally:
        zygote.close()


def _run_world(
    zygote: Zygote, logs: Path, world: int, scenario: str, timeout_s: float = 20.0
) -> list[dict[str, Any]]:
    port = _free_port()
    folder = Path(tempfile.mkdtemp(dir=logs))
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        processes.append(zygote.spawn(RANK, [scenario, str(timeout_s)], env, folder / f"rank{rank}.log"))
    return collect_results(processes, scenario, timeout=180)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_decrypts_the_mean(world: int, run_world: WorldRunner) -> None:
    results = run_world(world, "mean")
    for result in results:
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result


@pytest.mark.parametrize("world", [1, 2, 3, 5])  # 1: the blocking fallback (one sum of each, one decoder)
def test_every_rank_gets_the_mean_from_the_fused_aggregate(world: int, run_world: WorldRunner) -> None:
    results = run_world(world, "aggregate")
    for result in results:
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        # five rows, one slice per rank: each rank encrypted and c1-summed every slice, published its
        # c0_i + h_i for every slice, and received (and decoded) the summed shares of its own only
        records = result["records"]
        assert records.count("ciphertext") == records.count("decryption_share") == world, records
        assert records.count("decryption_sum") == 1, records


def test_the_fused_aggregate_over_a_channel_without_async_sums_has_every_rank_decode_every_row(
    run_world: WorldRunner,
) -> None:
    for result in run_world(3, "aggregate-blocking"):
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        records = result["records"]  # one ciphertext, one c1 sum, one contribution, the whole summed rows
        assert [records.count(name) for name in ("ciphertext", "c1_sum", "decryption_share")] == [1, 1, 1]
        assert records.count("decryption_sum") == 1, records


def _assert_the_others_name_the_missing_share(results: list[dict[str, Any]], leaver: int) -> None:
    """Every rank but the leaver fails with MissingSharesError naming it, within the share timeout."""
    for rank, result in enumerate(results):
        if rank == leaver:
            continue
        assert not result["ok"] and result["error"] == "MissingSharesError", result
        assert f"rank(s) [{leaver}] published none within {LEAVE_TIMEOUT_S:g}s" in result["message"]
        assert f"N-out-of-N decryption needs a decryption share from each of {len(results)} ranks" in result[
            "message"
        ]
        assert result["seconds"] < 60


def test_a_rank_that_leaves_before_its_fused_share_fails_every_other_rank_naming_it(
    run_world: WorldRunner,
) -> None:
    world, leaver, timeout_s = 3, 1, LEAVE_TIMEOUT_S
    results = run_world(world, f"aggregate-leave:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    _assert_the_others_name_the_missing_share(results, leaver)


@pytest.mark.parametrize("world", [1, 3])  # 1: the blocking fallback
def test_the_before_contribution_hook_runs_once_after_every_c1_sum_and_before_any_contribution(
    world: int,
    run_world: WorldRunner,
) -> None:
    for result in run_world(world, "aggregate-hook"):
        assert result["ok"], result.get("trace")
        assert result["max_error"] < 1e-6, result
        records = result["records"]
        assert records.count("before_contribution") == 1, records
        hook = records.index("before_contribution")
        assert records[:hook].count("c1_sum") == records.count("c1_sum") >= 1, records
        assert "decryption_share" not in records[:hook], records


def test_a_rank_leaving_in_the_before_contribution_hook_fails_every_other_rank_naming_it(
    run_world: WorldRunner,
) -> None:
    world, leaver, timeout_s = 3, 2, LEAVE_TIMEOUT_S
    results = run_world(world, f"aggregate-hook:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    assert results[leaver]["records"].count("c1_sum") == world  # it had every c1 sum, published no share
    assert "decryption_share" not in results[leaver]["records"]
    _assert_the_others_name_the_missing_share(results, leaver)


def test_a_rank_that_leaves_after_encrypting_fails_every_other_rank_naming_it(run_world: WorldRunner) -> None:
    world, leaver, timeout_s = 3, 2, LEAVE_TIMEOUT_S
    results = run_world(world, f"leave:{leaver}", timeout_s=timeout_s)
    assert results[leaver].get("left") is True
    for rank in range(world):
        if rank == leaver:
            continue
        result = results[rank]
        assert not result["ok"] and result["error"] == "MissingSharesError", result
        assert f"rank(s) [{leaver}] published none within {LEAVE_TIMEOUT_S:g}s" in result["message"]
        assert "N-out-of-N decryption needs a decryption share from each of 3 ranks" in result["message"]
        assert result["seconds"] < 60  # bounded: the timeout, not gloo's or forever


def test_a_rank_decrypting_another_ciphertext_is_named_before_any_share_moves(run_world: WorldRunner) -> None:
    results = run_world(3, "shape:1", timeout_s=20.0)
    for rank, result in enumerate(results):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        # decrypt (opted in) all-gathers the ciphertext's digest first: no share moves for a ciphertext
        # the ranks do not all hold
        assert "decryption 1 of session 'test' was refused before any share moved" in result["message"]
        named = "[0, 2]" if rank == 1 else "[1]"
        assert f"rank(s) {named} hold another ciphertext than rank {rank}" in result["message"], result[
            "message"
        ]


def test_a_rank_summing_another_key_share_than_it_committed_to_is_refused_on_every_rank(
    run_world: WorldRunner,
) -> None:
    # The rogue-key attack: the last hop of a ring all-reduce sees the others' partial sum and could
    # steer the collective key; the committed shares, opened after the sum, no longer add up to it.
    for result in run_world(3, "rogue-sum:2"):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert (
            "the summed key shares differ from the sum of the committed, opened shares" in result["message"]
        )


def test_a_rank_opening_another_key_share_than_it_committed_to_is_named(run_world: WorldRunner) -> None:
    for result in run_world(3, "rogue-open:1"):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert "rank(s) [1] opened a key share that does not match the commitment" in result["message"]


# The aggregator as an attacker (issue 29): a fold that answers the c1 exchange with the victim's c1,
# a subset sum, a scaled or negated sum, different sums to different ranks, an earlier round's sum,
# or 0 (which would reveal every c0) and then the new sum plus the victim's old c1. Every rank handed
# a wrong sum refuses it and publishes random residues in place of its contribution; every rank then
# refuses the round, naming it; on the sliced (process-group) path and on the blocking path (the relay
# road's) alike. Nothing the aggregator can combine from any round decodes to the victim's update.
C1_ATTACKS = {  # the rounds the attack is played in (the others are honest)
    "substitute": (1, 2),
    "subset": (1, 2),
    "scaled": (1, 2),
    "negated": (1, 2),
    "unreduced": (1, 2),
    "split": (1, 2),
    "replay": (2,),
    "zero-replay": (1, 2),
    "learned-challenge": (2,),
}
GUESS_ERROR = 1e3  # the updates lie in [-1, 1]: guessing 0 is off by at most 1


def _assert_victim_decodes_are_noise(result: dict[str, Any], rounds: int = 2) -> None:
    assert len(result["decodes"]) == rounds, result["decodes"]
    for decodes in result["decodes"]:
        for name in ("victim_alone", "victim_twice", "all_but_victim"):
            assert decodes[name] > GUESS_ERROR, (name, decodes)


@pytest.mark.parametrize("path", ["malicious", "malicious-blocking"])
@pytest.mark.parametrize("attack", sorted(C1_ATTACKS))
def test_a_malicious_fold_on_the_c1_sum_is_refused_and_no_contribution_it_collects_decodes(
    attack: str, path: str, run_world: WorldRunner
) -> None:
    results = run_world(3, f"{path}:{attack}")
    refused = C1_ATTACKS[attack]
    for result in results:
        assert result["ok"], result.get("trace")
        for number, outcome in enumerate(result["rounds"], start=1):
            if number not in refused:
                assert outcome["ok"] and outcome["max_error"] < 1e-6, outcome
                continue
            assert not outcome["ok"] and outcome["error"] == "SumCheckError", outcome
            assert f"aggregation round {number} of session 'test'" in outcome["message"], outcome
            assert "c1 sum" in outcome["message"], outcome
            if attack == "split" and result["rank"] == 0:  # handed the true sum: it published, then refused
                ranks = "to rank(s) [1, 2]" if path == "malicious" else "to 2 rank(s)"
                assert ranks in outcome["message"] and "own checked out" in outcome["message"], outcome
            else:
                assert "refuses to publish its decryption contribution" in outcome["message"], outcome
    # Every round ran to its end (no rank hangs on a refusing one): the aggregator collected one exchange
    # per slice per round, and nothing it can combine from any round decodes to the victim's update.
    slices = 3 if path == "malicious" else 1
    assert {result["published"] for result in results} == {2 * slices}
    _assert_victim_decodes_are_noise(results[0])


@pytest.mark.parametrize("path", ["malicious", "malicious-blocking"])
def test_a_fold_that_returns_another_sum_of_contributions_is_refused_and_learns_nothing(
    path: str, run_world: WorldRunner
) -> None:
    results = run_world(3, f"{path}:tamper-sum")
    for result in results:
        assert result["ok"], result.get("trace")
        for number, outcome in enumerate(result["rounds"], start=1):
            assert not outcome["ok"] and outcome["error"] == "SumCheckError", outcome
            assert f"aggregation round {number} of session 'test'" in outcome["message"], outcome
            assert "sum of the decryption contributions" in outcome["message"], outcome
    # every contribution was published (the c1 sums were honest); the victim's alone, or weighted
    # differently from the others', is noise
    _assert_victim_decodes_are_noise(results[0])


@pytest.mark.parametrize("path", ["malicious", "malicious-blocking"])
def test_the_challenge_is_what_stops_a_forged_sum_a_fold_that_knows_it_is_not_caught(
    path: str, run_world: WorldRunner
) -> None:
    """The control of the "learned-challenge" attack: the same forgery built with round 2's own
    multipliers (what a rank colluding with the fold could hand it) passes every check and decodes to
    something else than the sum. The checks rest on the challenge key staying with the ranks.
    """
    for result in run_world(3, f"{path}:current-challenge"):
        assert result["ok"], result.get("trace")
        first, second = result["rounds"]
        assert first["ok"] and first["max_error"] < 1e-6, first
        assert second["ok"] and second["max_error"] > GUESS_ERROR, second


def test_a_rank_that_seals_different_challenge_seeds_to_different_ranks_is_named_at_key_generation(
    run_world: WorldRunner,
) -> None:
    """Ranks holding different challenge keys would refuse every honest round with a misleading
    verdict: key generation refuses instead, on every rank, naming the rank that dealt two seeds.
    """
    for result in run_world(3, "equivocate:1"):
        assert not result["ok"] and result["error"] == "ChallengeKeyError", result
        assert "rank(s) [1] sealed different challenge seeds to different ranks" in result["message"], result


def test_decrypt_refuses_without_the_explicit_opt_in(run_world: WorldRunner) -> None:
    for result in run_world(2, "decrypt-no-opt-in"):
        assert not result["ok"] and result["error"] == "MultipartyError", result
        assert "never call it on a ciphertext an aggregator returned" in result["message"]
        assert "assume_identical=True" in result["message"]
