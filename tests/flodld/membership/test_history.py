"""The history file's format (sans-io): round trip, bounds, damaged and truncated files, newer versions."""

from __future__ import annotations

import json

import pytest

from flodld.membership.history import (
    HISTORY_VERSION,
    HistoryVersionError,
    decode_history,
    encode_history,
    header,
    record_run,
)
from flodld.membership.phase import Phase
from flodld.membership.snapshot import AttemptState, EarlierAttempt, RankExit, RunRecord


def record(n: int, hosts: int = 2) -> RunRecord:
    return RunRecord(
        run_id=f"run-{n}",
        verdict=Phase.DONE if n % 2 else Phase.FAILED,
        reason=f"reason {n}: ünïcode\nand a newline",
        started_at=1000.0 + n,
        formed_at=None if n % 3 == 0 else 1001.5 + n,
        ended_at=1010.0 + n,
        ranks=hosts,
        hosts=[f"host-{n}-{i}" for i in range(hosts)],
        host_count=hosts,
        rank_exits=[RankExit(rank=i, code=0) for i in range(hosts)],
    )


def test_round_trip_keeps_every_field_and_the_order() -> None:
    records = [record(n) for n in range(5, 0, -1)]
    data = encode_history(records, limit_runs=50)
    assert data.startswith(header()) and data.count(b"\n") == 6  # one line per record
    load = decode_history(data, source="h.jsonl", limit_runs=50)
    assert load.records == records and load.damaged == [] and load.warning("h.jsonl") is None


def test_empty_input_is_an_empty_history() -> None:
    assert decode_history(b"", source="h", limit_runs=5).records == []
    assert decode_history(encode_history([], limit_runs=5), source="h", limit_runs=5).records == []


def test_bounded_by_runs_and_by_bytes_keeping_the_newest() -> None:
    records = [record(n, hosts=20) for n in range(30, 0, -1)]
    assert len(decode_history(encode_history(records, limit_runs=7), source="h", limit_runs=50).records) == 7
    limit = 4096
    data = encode_history(records, limit_runs=50, limit_bytes=limit)
    assert len(data) <= limit
    kept = decode_history(data, source="h", limit_runs=50).records
    assert 0 < len(kept) < 30 and kept == records[: len(kept)]  # the oldest are the ones left out
    # reading applies the run bound too (a smaller history_runs after a restart)
    assert len(decode_history(encode_history(records, limit_runs=50), source="h", limit_runs=3).records) == 3


def test_a_truncated_file_keeps_the_whole_records_and_names_the_cut() -> None:
    records = [record(n) for n in range(4, 0, -1)]
    data = encode_history(records, limit_runs=50)
    cut = data[: len(data) - 40]  # inside the last record
    load = decode_history(cut, source="/var/lib/flodld/history.jsonl", limit_runs=50)
    assert load.records == records[:3]
    assert load.damaged == ["line 5: cut off (truncated JSON)"]
    warning = load.warning("/var/lib/flodld/history.jsonl")
    assert warning is not None
    assert "/var/lib/flodld/history.jsonl" in warning and "skipped 1 unreadable line" in warning
    assert "kept the 3 intact runs" in warning


def test_damaged_lines_are_skipped_and_named_the_rest_load() -> None:
    records = [record(n) for n in range(4, 0, -1)]
    lines = encode_history(records, limit_runs=50).split(b"\n")
    lines[2] = b"\x00\xffgarbage{"  # record 2 (run-3): not JSON
    bad = json.loads(lines[3])
    bad["ranks"] = "many"
    lines[3] = json.dumps(bad).encode()  # record 3 (run-2): JSON, but not a run record
    load = decode_history(b"\n".join(lines), source="h.jsonl", limit_runs=50)
    assert [r.run_id for r in load.records] == ["run-4", "run-1"]
    assert load.damaged[0] == "line 3: not JSON"
    assert load.damaged[1].startswith("line 4: not a run record (ranks:")


def test_a_missing_header_is_damage_but_the_records_still_load() -> None:
    records = [record(n) for n in range(3, 0, -1)]
    body = encode_history(records, limit_runs=50)[len(header()) :]
    load = decode_history(body, source="h", limit_runs=50)
    assert load.records == records
    assert load.damaged == ["line 1: not a flodld history header"]
    garbage = decode_history(b"not json at all\n" + body, source="h", limit_runs=50)
    assert garbage.records == records and garbage.damaged == ["line 1: not a flodld history header"]


def test_many_damaged_lines_are_counted_past_the_first_few() -> None:
    load = decode_history(header() + b"x\n" * 12, source="h", limit_runs=50)
    warning = load.warning("h")
    assert load.skipped == 12 and warning is not None and "and 7 more" in warning


def test_a_newer_version_is_refused_naming_the_file_both_versions_and_the_fix() -> None:
    newer = json.dumps({"format": "flodld-history", "version": HISTORY_VERSION + 1}).encode() + b"\n"
    data = newer + encode_history([record(1)], limit_runs=5)[len(header()) :]
    with pytest.raises(HistoryVersionError) as raised:
        decode_history(data, source="/state/history.jsonl", limit_runs=5)
    message = str(raised.value)
    assert "/state/history.jsonl" in message and f"format {HISTORY_VERSION + 1}" in message
    assert f"reads up to {HISTORY_VERSION}" in message and "upgrade flodld" in message


def test_fields_flow_through_the_model_generically() -> None:
    """The file is RunRecord's own dump: every field of the model is a key of each line."""
    data = encode_history([record(1)], limit_runs=5)
    line = json.loads(data.split(b"\n")[1])
    assert set(line) == set(RunRecord.model_fields)


def test_a_field_a_newer_flodld_added_is_left_out_and_the_record_loads() -> None:
    data = encode_history([record(1)], limit_runs=5)
    line = json.loads(data.split(b"\n")[1])
    line["root_cause_from_the_future"] = {"rank": 3}
    load = decode_history(header() + json.dumps(line).encode() + b"\n", source="h", limit_runs=5)
    assert load.records == [record(1)] and load.damaged == []


def test_the_history_keeps_one_entry_per_run_its_latest_attempt_naming_the_earlier_ones() -> None:
    from collections import deque

    def attempt(n: int, number: int, earlier: list[RunRecord]) -> RunRecord:
        causes = [EarlierAttempt.of(r, i + 1) for i, r in enumerate(earlier)]
        state = AttemptState(number=number, max_attempts=3, earlier=causes)
        return record(n).model_copy(update={"attempt": state})

    history: deque[RunRecord] = deque([record(0)], maxlen=10)
    first = attempt(1, 1, [])
    record_run(history, first)
    second = attempt(2, 2, [first])
    record_run(history, second)
    third = attempt(3, 3, [first, second])
    record_run(history, third)
    assert list(history) == [third, record(0)]  # one run, its attempts in attempt.earlier
    assert third.attempt is not None and [a.run_id for a in third.attempt.earlier] == ["run-1", "run-2"]
    fresh = attempt(4, 1, [])
    record_run(history, fresh)  # the next run starts at attempt 1: a new entry
    assert list(history) == [fresh, third, record(0)]
