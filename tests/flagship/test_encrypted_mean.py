"""The encrypted-mean workload under `fdl run`: real controller, agent, relay and ranks on loopback.

Small on purpose: 4096 values are one ciphertext of the aggregation ring (N = 2^13).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.harness import Fdl, free_port
from tests.flagship.workload import ENCRYPTED_MEAN, assert_encrypted_mean_passed, encrypted_mean_args

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).resolve().parent / "programs" / "mean_with_faults.py"
VALUES = "4096"
# How long the survivors of a rank that left wait for its share. On the process-group road every exchange
# follows init_process_group's barrier, so a live rank is late only by its compute between two exchanges.
# On the relay road the first exchange (the descriptor handshake) also absorbs the ranks' different torch
# import times.
SHARE_TIMEOUT = {"process-group": "3", "relay": "5"}


def ranks_said(output: str) -> str:
    """The output without `fdl run`'s root-cause block, which quotes the failed rank's last lines again."""
    return "\n".join(line for line in output.splitlines() if not line.startswith("fdl run:   "))


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_relay_transport_is_the_default_under_cpu_averaging_and_every_rank_passes(ranks: int) -> None:
    # The default is threshold keys: no key holder, every rank decrypts the mean with the others' shares.
    run = Fdl("run", "--ranks", str(ranks), str(ENCRYPTED_MEAN), "--", "--values", VALUES)
    assert run.wait(240) == 0, run.output
    errors = assert_encrypted_mean_passed(run.output, ranks, transport="relay")
    assert all(error < 1e-6 for error in errors)
    assert len(set(errors)) == 1, run.output  # every rank decrypted the same sum
    assert (
        len(re.findall(rf"all_reduce_add_ciphertext over {ranks} rank\(s\) via relay", run.output)) == ranks
    )
    assert len(re.findall(rf"collective decryption from {ranks} decryption shares", run.output)) == ranks
    assert len(re.findall(r"checked here\) .* keys threshold", run.output)) == ranks
    assert "fdl run: run done" in run.output


@pytest.mark.parametrize(("ranks", "form"), [(2, []), (3, ["--lower"]), (5, [])])
def test_process_group_transport_runs_the_specialized_and_lowered_program(
    ranks: int, form: list[str]
) -> None:
    run = Fdl(
        "run",
        "--ranks",
        str(ranks),
        str(ENCRYPTED_MEAN),
        "--",
        *encrypted_mean_args(int(VALUES), transport="process-group"),
        *form,
    )
    assert run.wait(240) == 0, run.output
    errors = assert_encrypted_mean_passed(run.output, ranks, transport="process-group")
    # Every rank decrypts the mean itself (threshold keys) and checks it.
    assert len(errors) == ranks and len(set(errors)) == 1 and max(errors) < 1e-6, run.output
    assert len(re.findall(r"checked here\) .* keys threshold", run.output)) == ranks


def test_single_key_mode_keeps_rank_0_as_the_key_holder() -> None:
    run = Fdl("run", "--ranks", "2", str(ENCRYPTED_MEAN), "--", "--values", VALUES, "--keys", "single")
    assert run.wait(240) == 0, run.output
    errors = assert_encrypted_mean_passed(run.output, 2, transport="relay")
    assert all(error < 1e-6 for error in errors)
    assert "key holder rank 0" in run.output and "keys single" in run.output
    assert len(re.findall(r"as measured by the key holder", run.output)) == 1  # rank 1 relies on rank 0


@pytest.mark.parametrize("transport", ["relay", "process-group"])
def test_a_rank_leaving_after_encrypting_fails_every_other_rank_naming_its_missing_share(
    transport: str,
) -> None:
    run = Fdl(
        "run",
        "--ranks",
        "3",
        str(PROGRAM),
        "--",
        "--values",
        VALUES,
        "--keys",
        "threshold",
        "--transport",
        transport,
        "--fault",
        "leave",
        "--fault-rank",
        "2",
        "--share-timeout",
        SHARE_TIMEOUT[transport],
    )
    assert run.wait(240) == 1, run.output
    assert "rank 2: leaving after encrypting, before its decryption share" in run.output
    failed = re.findall(
        r"rank ([01]): FAILED: MissingSharesAggregationError: N-out-of-N decryption needs a "
        r"decryption share from each of 3 ranks; rank\(s\) \[2\] published none",
        ranks_said(run.output),
    )
    assert sorted(failed) == ["0", "1"], run.output
    assert "encrypted mean PASS" not in run.output


@pytest.mark.parametrize(
    ("transport", "fault", "named"),
    [
        ("relay", "values", r"values=4097 \(key holder: 4096\)"),
        ("process-group", "scale", r"scale=549755813888\.0 \(key holder: 2199023255552\.0\)"),
    ],
    ids=["relay-values", "process-group-scale"],
)
def test_ranks_with_different_parameters_are_refused_by_the_descriptor_handshake(
    transport: str, fault: str, named: str
) -> None:
    run = Fdl("run", str(PROGRAM), "--", "--values", VALUES, "--transport", transport, "--fault", fault)
    assert run.wait(240) == 1, run.output
    refusals = re.findall(
        r"rank \d: FAILED: ParameterMismatchError: ranks disagree .*rank 1: " + named, ranks_said(run.output)
    )
    assert len(refusals) >= 1, run.output
    assert "encrypted mean PASS" not in run.output


def test_a_rank_encrypting_under_its_own_key_is_refused_before_any_ciphertext_moves() -> None:
    run = Fdl(
        "run",
        "--ranks",
        "3",
        str(PROGRAM),
        "--",
        "--values",
        VALUES,
        "--fault",
        "foreign-key",
        "--fault-rank",
        "2",
    )
    assert run.wait(240) == 1, run.output
    assert re.search(
        r"FAILED: KeyMismatchError: rank\(s\) \[2\] would encrypt under public key", run.output
    ), run.output
    assert "all_reduce_add_ciphertext over" not in run.output


def test_a_rank_leaving_mid_run_is_reported_as_a_changed_world_on_the_relay_path() -> None:
    run = Fdl(
        "run", "--ranks", "3", str(PROGRAM), "--", "--values", VALUES, "--fault", "leave", "--fault-rank", "2"
    )
    assert run.wait(240) == 1, run.output
    assert "rank 2: leaving before the all-reduce" in run.output
    changed = re.findall(
        r"rank [01]: FAILED: WorldChangedError: the world changed mid-run: round \d+ folded ranks "
        r"\[0, 1\] but the world has 3 \(rank\(s\) \[2\] left\)",
        ranks_said(run.output),
    )
    assert len(changed) == 2, run.output
    assert "encrypted mean PASS" not in run.output


def test_a_rank_leaving_mid_run_fails_the_process_group_path_with_a_clear_error() -> None:
    run = Fdl(
        "run", str(PROGRAM), "--", "--values", VALUES, "--transport", "process-group", "--fault", "leave"
    )
    assert run.wait(240) == 1, run.output
    assert re.search(
        r"rank 0: FAILED: WorldChangedError: the all-reduce failed, a rank probably left", run.output
    ), run.output


@pytest.mark.parametrize("attack", ["substitute", "subset"])
def test_a_malicious_controller_fold_is_refused_on_the_relay_road_before_any_share_is_published(
    attack: str, tmp_path: Path
) -> None:
    # Issue 29: the controller answers the c1 sum with the victim's own frame (or the sum of the
    # others'); before the fix every rank published a decryption share for it and printed the victim's
    # update as "the mean". Now every rank refuses, naming the round, and publishes random residues in
    # place of its contribution.
    run = Fdl(
        "run",
        "--ranks",
        "3",
        str(PROGRAM),
        "--",
        "--values",
        VALUES,
        "--keys",
        "threshold",
        "--malicious-fold",
        attack,
        "--fault-rank",
        "1",
        "--audit-dir",
        str(tmp_path),
    )
    assert run.wait(240) != 0, run.output
    answers = re.findall(rf"the fold answers round \d+ with a {attack} sum", ranks_said(run.output))
    assert len(answers) == 3, run.output
    refusals = re.findall(
        r"rank (\d): FAILED: AggregationError: aggregation round 1 of session '[^']*': the c1 sum the "
        r"channel \(the aggregator's fold\) returned is not the sum of this round's 3 inputs",
        ranks_said(run.output),
    )
    assert sorted(int(rank) for rank in refusals) == [0, 1, 2], run.output
    assert "encrypted mean PASS" not in run.output and "encrypted mean FAIL" not in run.output
    assert "ThresholdSession.decrypt called" not in run.output
    # nothing derived from the forged sum was published: no rank made a contribution (decryption share),
    # each published uniform residues in its place
    assert sorted(path.name for path in tmp_path.glob("rank*-decryption_share.pt")) == []
    assert len(list(tmp_path.glob("rank*-random_contribution.pt"))) == 3
    assert len(list(tmp_path.glob("rank*-c1_ciphertext.pt"))) == 3


@pytest.mark.parametrize("attack", ["substitute", "subset", "scaled", "negated", "split"])
def test_t_of_n_keys_refuse_a_malicious_controller_fold_on_the_relay_road_before_any_share_is_published(
    attack: str, tmp_path: Path
) -> None:
    # The controller answers the whole ciphertexts' sum of the t-out-of-N round (every rank present,
    # so the relays fold it) with a forged one: every rank refuses, naming the round, and no rank makes
    # a (Lagrange-scaled) decryption share, so nothing the fold could decode was ever published.
    run = Fdl(
        "run", "--ranks", "3", str(PROGRAM), "--", "--values", VALUES, "--keys", "threshold",
        "--threshold", "2", "--transport", "relay", "--malicious-fold", attack, "--fault-rank", "1",
        "--share-timeout", "20", "--audit-dir", str(tmp_path),
    )
    assert run.wait(240) != 0, run.output
    said = ranks_said(run.output)
    assert len(re.findall(rf"the fold answers round \d+ with a {attack} sum", said)) == 3, run.output
    refusals = re.findall(
        r"rank (\d): FAILED: AggregationError: aggregation round 1 of session 'encrypted-mean': the "
        r"ciphertext sum the channel \(the aggregator's fold\) returned (is not the sum of this round's "
        r"inputs of ranks \[0, 1, 2\]|differs between ranks).*; rank \1 refuses to publish its decryption "
        r"share",
        said,
    )
    assert sorted(int(rank) for rank, _ in refusals) == [0, 1, 2], run.output
    if attack == "split":  # each rank names the ranks that were handed another sum than its own
        assert {why for _, why in refusals} == {"differs between ranks"}, run.output
    assert "encrypted mean PASS" not in run.output and "encrypted mean FAIL" not in run.output
    assert sorted(path.name for path in tmp_path.glob("rank*-decryption_share.pt")) == []
    assert len(list(tmp_path.glob("rank*-ciphertext.pt"))) == 3


# (fault, what rank 2 says as it leaves, whose inputs the mean covers): before contributing, after (its
# input is in the checked sum), and mid-decryption (its share made, not summed: the others re-choose)
T_OF_N_LEAVERS = [
    ("leave-early", "rank 2: leaving at 'update' (leave-early)", "[0, 1] (2 of 3)"),
    ("leave", "rank 2: leaving after encrypting, before its decryption share", "[0, 1, 2] (3 of 3)"),
    ("leave-mid", "rank 2: leaving at 'decryption_share' (leave-mid)", "[0, 1, 2] (3 of 3)"),
]


@pytest.mark.parametrize("transport", ["relay", "process-group"])
@pytest.mark.parametrize(("fault", "left", "covered"), T_OF_N_LEAVERS, ids=[f[0] for f in T_OF_N_LEAVERS])
def test_t_of_n_keys_let_the_survivors_decrypt_the_mean_when_a_rank_leaves_at_each_phase(
    transport: str, fault: str, left: str, covered: str, tmp_path: Path
) -> None:
    # 3 ranks, threshold 2: rank 2 leaves, the other two decrypt the mean of the inputs the sum covers,
    # and say whose. On the relay road rank 2 is SIGKILLed, under a run tolerance of 1 (its host-mates
    # keep running, docs/elastic-averaging.md); the process-group road exits 0 (not elastic: a rank
    # dying by a signal tears the host down).
    where: tuple[str, ...] = ("--ranks", "3")
    leave_by = "exit"
    if transport == "relay":
        (tmp_path / "fdl.yml").write_text(
            "cluster:\n  controller:\n    host: 127.0.0.1\n"
            f"    port: {free_port()}\n"
            "    averaging: cpu_sync\n    tolerance: 1\n"
            "  workers:\n    - host: 127.0.0.1\n      local_devices: [\"cpu:3\"]\n"
        )
        where, leave_by = ("--project", str(tmp_path)), "kill"
    run = Fdl(
        "run", *where, str(PROGRAM), "--", "--values", VALUES, "--keys", "threshold",
        "--threshold", "2", "--transport", transport, "--fault", fault, "--fault-rank", "2",
        "--share-timeout", SHARE_TIMEOUT[transport], "--leave-by", leave_by,
    )
    assert run.wait(240) == 0, run.output
    if transport == "relay":  # the run survived the kill within its tolerance, and says so
        assert "degraded: ranks [2] lost" in run.output, run.output
    said = ranks_said(run.output)
    assert left in said
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank}: t-out-of-N aggregation \(threshold 2\) in [0-9.]+s: the mean covers the inputs "
            rf"of rank\(s\) {re.escape(covered)}; decrypted by rank\(s\) \[0, 1\]",
            said,
        ), said
        passed = rf"rank {rank}: encrypted mean PASS: .* transport {transport} keys threshold"
        assert re.search(passed, said), said


def test_t_of_n_with_fewer_than_t_survivors_fails_every_survivor_naming_the_missing_rank_relay_road() -> None:
    run = Fdl(
        "run", "--ranks", "3", str(PROGRAM), "--", "--values", VALUES, "--keys", "threshold",
        "--threshold", "3", "--transport", "relay", "--fault", "leave", "--fault-rank", "1",
        "--share-timeout", "5",
    )
    assert run.wait(240) == 1, run.output
    failed = re.findall(
        r"rank ([02]): FAILED: MissingSharesAggregationError: aggregation round 1 of session "
        r"'encrypted-mean': t-out-of-N decryption needs 3 of 3 ranks; only rank\(s\) \[0, 2\] arrived within "
        r"5s \(rank\(s\) \[1\] left or stalled\)",
        ranks_said(run.output),
    )
    assert sorted(failed) == ["0", "2"], run.output
