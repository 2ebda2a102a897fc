"""bench/chaos.py's figures from its logs: the consistency check, throughput, detection and rejoin times.

The bench itself (processes, namespaces, faults) takes minutes and is run by hand (docs/operations.md);
these are the pure functions that turn what a run left behind into its table.
"""

from __future__ import annotations

import json
from pathlib import Path

from chaoslib import (
    Fault,
    RankLog,
    attribute_loss,
    false_alarms,
    match_joins,
    match_losses,
    missing_rank_seconds,
    pooled_rate,
    quiet_pace,
    read_last_rounds,
    read_logs,
    run_figures,
    start_up_windows,
)


def _log(rank: int, host: str, rounds: list[tuple[int, float, str]], samples: int = 64) -> RankLog:
    lines = [{"round": n, "t": t, "samples": samples, "members": [], "sha": sha} for n, t, sha in rounds]
    return RankLog(rank, host, 1000 + rank, lines)


def test_a_round_whose_survivors_hold_different_bytes_is_counted_inconsistent() -> None:
    a = _log(0, "h0", [(0, 10.0, "x0"), (1, 11.0, "x1"), (2, 12.0, "x2"), (3, 13.0, "x3")])
    b = _log(1, "h1", [(0, 10.0, "x0"), (1, 11.0, "x1"), (2, 12.0, "DIFFERENT")])  # lost after round 2
    figures = run_figures([a, b], window=1.0)
    assert figures.inconsistent == [2]
    assert figures.rounds == 4 and figures.smallest_world == 1
    # The first round's samples were trained before the clock started: 5 lines after it, over 3 s.
    assert figures.samples == 5 * 64 and figures.seconds == 3.0
    assert figures.window_rates == [128.0, 128.0, 64.0]
    assert run_figures([a, a], window=1.0).inconsistent == []


def test_detection_is_the_first_loss_of_a_faulted_rank_and_rejoin_the_hosts_first_join() -> None:
    started = 1000.0
    kill = Fault("agent SIGKILL", "h1", [2, 3], at=1020.0)
    stop = Fault("rank SIGSTOP", "h2", [4], at=1035.0)
    losses = [
        {"rank": 3, "host": "h1", "at_secs": 20.4},
        {"rank": 2, "host": "h1", "at_secs": 20.2},
        {"rank": 4, "host": "h2", "at_secs": 40.5},
        {"rank": 5, "host": "h2", "at_secs": 10.0},  # an earlier loss of no fault here
    ]
    match_losses([kill, stop], losses, started)
    assert kill.detected is not None and abs(kill.detected - 0.2) < 1e-9
    assert stop.detected is not None and abs(stop.detected - 5.5) < 1e-9
    joins = [{"rank": 2, "host": "h1", "round": 70}, {"rank": 4, "host": "h2", "at_secs": 48.0}]
    match_joins([kill, stop], joins, started, {70: 1031.0})
    assert kill.rejoined == 11.0 and stop.rejoined == 13.0
    missing = Fault("partition", "h3", [6, 7], at=1050.0)
    match_losses([missing], losses, started)
    match_joins([missing], joins, started, {})
    assert missing.detected is None and missing.rejoined is None


def test_a_false_alarm_is_a_silence_loss_of_a_rank_no_fault_touched() -> None:
    stop = Fault("rank SIGSTOP", "h2", [4], at=1040.0)
    silent = "rank {} on 'h2' sent no heartbeat for 1.5s (round 9 in progress)"
    losses = [
        {"rank": 4, "host": "h2", "cause": silent.format(4), "at_secs": 41.5},  # the fault's: detected
        {"rank": 5, "host": "h2", "cause": "lost with its host: host closed its join link", "at_secs": 60.0},
        {"rank": 6, "host": "h3", "cause": silent.format(6), "at_secs": 70.0},  # nothing stopped it
    ]
    assert [loss["rank"] for loss in false_alarms([stop], losses)] == [6]
    assert false_alarms([stop], losses[:2]) == []


def test_logs_are_read_per_rank_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    header = {"header": True, "rank": 3, "host": "h1", "pid": 77}
    line = {"round": 0, "t": 1.0, "samples": 64, "members": [3], "sha": "ab"}
    (tmp_path / "r3-77.jsonl").write_text(f'{json.dumps(header)}\n{json.dumps(line)}\n{{"round": 1, "t')
    (log,) = read_logs(tmp_path)
    assert (log.rank, log.host, log.pid, log.rounds) == (3, "h1", 77, [line])


def test_a_faults_placement_reads_each_ranks_last_round_only(tmp_path: Path) -> None:
    header = {"header": True, "rank": 5, "host": "h2+1", "pid": 78}
    lines = [{"round": n, "t": float(n), "samples": 64, "members": [5], "sha": "ab"} for n in range(400)]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "r5-78.jsonl").write_text(f'{json.dumps(header)}\n{body}{{"round": 400, "t')
    (tmp_path / "r6-79.jsonl").write_text(json.dumps({**header, "rank": 6, "pid": 79}) + "\n")
    logs = read_last_rounds(tmp_path)
    assert [(log.rank, log.host, log.pid, log.rounds) for log in logs] == [
        (5, "h2+1", 78, [lines[-1]]),  # the last whole line of a long log (the torn one skipped)
        (6, "h2+1", 79, []),  # no round yet
    ]


def test_the_loss_is_split_between_detection_stalls_host_start_ups_and_the_rest() -> None:
    """Fault-free rate 100 samples/s. Over 10 s the chaos run trains nothing in [2, 3) (a stall), half the
    rate in [5, 7) (a host starting), and loses 50 more samples elsewhere.
    """
    rounds: list[tuple[int, float, str]] = []
    number = 0
    for tenth in range(101):
        t = tenth / 10
        if 2 <= t < 3 or (5 <= t < 7 and tenth % 2):
            continue
        if tenth in (80, 81, 82, 83, 84):  # 5 rounds of 10 samples lost outside any window
            continue
        rounds.append((number, t, "x"))
        number += 1
    log = _log(0, "h0", rounds, samples=10)
    shares = attribute_loss([log], 100.0, {"stalls": [(2.0, 3.0)], "start-ups": [(5.0, 7.0)]})
    assert {k: round(v, 3) for k, v in shares.items()} == {"stalls": 0.1, "start-ups": 0.1, "other": 0.05}


def test_a_hosts_start_up_runs_from_its_admission_to_the_round_it_entered_at() -> None:
    joins = [
        {"rank": 8, "host": "h1", "round": 40, "at_secs": 20.0},
        {"rank": 9, "host": "h1", "round": 40, "at_secs": 20.0},
        {"rank": 10, "host": "h2", "round": None, "at_secs": 30.0},  # admitted, never entered
    ]
    assert start_up_windows(joins, 1000.0, {40: 1026.5}) == [(1020.0, 1026.5)]


def test_missing_rank_seconds_hold_each_rounds_members_until_the_next_round() -> None:
    a = _log(0, "h0", [(0, 10.0, "x"), (1, 11.0, "x"), (2, 13.0, "x"), (3, 14.0, "x")])
    b = _log(1, "h1", [(0, 10.0, "x"), (3, 14.0, "x")])  # out for rounds 1 and 2, back at round 3
    # A world of 3: rounds 0 (2 ranks, 1 s), 1 (1 rank, 2 s), 2 (1 rank, 1 s) -> 1 + 4 + 2 = 7.
    assert missing_rank_seconds([a, b], world=3) == (7.0, 4.0)
    assert missing_rank_seconds([], world=3) == (0.0, 0.0)


def test_the_fault_free_runs_around_a_chaos_run_pool_their_samples_over_their_seconds() -> None:
    # 64 samples a round: 10 rounds a second for 10 s, then 5 a second for 20 s (after each first round).
    fast = run_figures([_log(0, "h0", [(n, n / 10, "x") for n in range(101)])], window=5.0)
    slow = run_figures([_log(0, "h0", [(n, n / 5, "x") for n in range(101)])], window=5.0)
    assert (fast.rate, slow.rate) == (640.0, 320.0)
    assert pooled_rate([fast, slow]) == 12800 / 30.0  # not 480, the mean of the rates: longer runs weigh more
    assert pooled_rate([fast]) == fast.rate and pooled_rate([]) == 0.0


def test_the_quiet_pace_is_the_median_round_rate_of_whole_world_seconds_away_from_faults() -> None:
    # 4 rounds a second for 20 s, but seconds 8-9 hold a fault (2 rounds a second there) and in second 14
    # one rank is missing: neither counts, nor do the first and last 3 s (start-up, wind-down).
    rounds = []
    for index in range(80):
        t = 100.0 + index * 0.25
        if 108.0 <= t < 110.0 and index % 2:
            continue
        rounds.append((index, t, "aa"))
    full = _log(0, "h0", rounds)
    partial = _log(1, "h1", [r for r in rounds if not 114.0 <= r[1] < 115.0])
    assert quiet_pace([full, partial], 2, [(108.0, 110.0)]) == 4
    assert quiet_pace([full, partial], 2, [(100.0, 120.0)]) is None  # every second near a fault
    assert quiet_pace([], 2, []) is None
